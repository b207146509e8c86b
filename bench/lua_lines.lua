-- Where the budget function's Lua spends its VM instructions, line by line
-- (lua/README.md): runs the library's budget function in plain Lua 5.1,
-- Redis's Lua, against a table-backed stand-in for the few commands a
-- fixed-window reservation makes, with the calls bench/budget_calls.py
-- makes (PAIRS reserves on new keys and the settles of the call before's),
-- and counts the VM instructions of each line with a count hook. Redis's
-- own cost (commands, arguments, replies, garbage) is not here: callgrind
-- on redis-server measures that (bench/lua_instructions.sh).
--
--   apt-get install lua5.1
--   target/release/ratekeeper --write-limiter-library /tmp/library.lua
--   lua5.1 bench/lua_lines.lua /tmp/library.lua [PAIRS=15] [CALLS=100] [LINES=40]
local library, pairs_per_call, calls, shown =
  arg[1], tonumber(arg[2] or 15), tonumber(arg[3] or 100), tonumber(arg[4] or 40)
assert(library, 'usage: lua5.1 bench/lua_lines.lua LIBRARY [PAIRS] [CALLS] [LINES]')

local db, now_ms = {}, 1800000000000
local commands = {
  TIME = function()
    return { tostring(math.floor(now_ms / 1000)), tostring(now_ms % 1000 * 1000) }
  end,
  HMGET = function(key, ...)
    local hash, reply = db[key] or {}, {}
    for i, field in ipairs({ ... }) do
      reply[i] = hash[field] or false
    end
    return reply
  end,
  HSET = function(key, ...)
    local hash, args = db[key] or {}, { ... }
    db[key] = hash
    for i = 1, #args, 2 do
      hash[args[i]] = args[i + 1]
    end
    return 1
  end,
  HINCRBY = function(key, field, by)
    local hash = db[key] or {}
    db[key] = hash
    local n = (tonumber(hash[field]) or 0) + tonumber(by)
    hash[field] = tostring(n)
    return n
  end,
  HSETNX = function(key, field, value)
    local hash = db[key] or {}
    db[key] = hash
    if hash[field] then
      return 0
    end
    hash[field] = value
    return 1
  end,
  HGET = function(key, field)
    return (db[key] or {})[field] or false
  end,
  PTTL = function() return -1 end,
  PEXPIRE = function() return 1 end,
  SET = function(key, value) db[key] = value; return { ok = 'OK' } end,
  GET = function(key)
    local value = db[key]
    return type(value) == 'string' and value or false
  end,
  MGET = function(...)
    local reply = {}
    for i, key in ipairs({ ... }) do
      local value = db[key]
      reply[i] = type(value) == 'string' and value or false
    end
    return reply
  end,
  SETRANGE = function(key, _, value)
    db[key] = value .. string.sub(db[key], #value + 1)
    return #db[key]
  end,
}
local functions = {}
-- Redis's cmsgpack packs the reply (its cost is Redis's, not the VM's):
-- here the table goes back as it is.
cmsgpack = { pack = function(t) return t end }
redis = {
  call = function(name, ...)
    -- Redis turns a number argument into a string (%.17g) as well.
    local args = { ... }
    for i, a in ipairs(args) do
      if type(a) == 'number' then
        args[i] = string.format('%.17g', a)
      end
    end
    return assert(commands[name], name)(unpack(args))
  end,
  register_function = function(name, f) functions[name] = f end,
  error_reply = function(message) return { err = message } end,
}
local source = io.open(library):read('*a'):gsub('^#![^\n]*\n', '')
assert(loadstring(source, 'library'))()
local budget
for name, f in pairs(functions) do
  if name:match('_budget$') then
    budget = f
  end
end

local FIELDS = 'fw 1000000000 3600000 0 100 1 0'
local counts, total = {}, 0
local function count()
  local info = debug.getinfo(2, 'Sl')
  if info and info.short_src == '[string "library"]' then
    counts[info.currentline] = (counts[info.currentline] or 0) + 1
    total = total + 1
  end
end

-- Each call: PAIRS reserves on new keys, then the settles of the call
-- before's reservations (their times and marks from its answers), each
-- recorded in its second's bucket under its nonce.
local pending = {}
local function call(n0, counted)
  local keys, argv, made = {}, { '' }, {}
  for i = 1, pairs_per_call do
    local counter = string.format('rk:{bench_fw|user_id=k%d}:fw.3600', n0 + i)
    keys[#keys + 1] = counter
    argv[#argv + 1], argv[#argv + 2] = 'reserve 1 300000', FIELDS
    made[#made + 1] = { counter, string.format('%032x', n0 + i) }
  end
  for _, m in ipairs(pending) do
    local expires = m.at + 300000
    keys[#keys + 1] = m[1]
    keys[#keys + 1] = string.format('rk:rsvb.%d.%s', math.floor(expires / 1000), m[2]:sub(1, 1))
    argv[#argv + 1] = string.format('settle 1 60 %d 0', expires)
    argv[#argv + 1], argv[#argv + 2], argv[#argv + 3] = FIELDS, m.at .. ' ' .. m.mark, m[2]
  end
  if counted then
    debug.sethook(count, '', 1)
  end
  local reply = budget(keys, argv)
  debug.sethook()
  assert(type(reply) == 'table' and reply.err == nil, 'the budget function failed')
  -- The reserves' answers come first: length 6, granted, 3 fields, time, mark.
  for i, m in ipairs(made) do
    local at = (i - 1) * 7 + 1
    assert(reply[at] == 6 and reply[at + 1] == 1, 'a reserve was refused')
    m.at, m.mark = reply[at + 5], reply[at + 6]
  end
  pending, now_ms = made, now_ms + 1
end

for c = 1, 20 do
  call(c * pairs_per_call, false)
end
for c = 1, calls do
  call(1000000 + c * pairs_per_call, true)
end

local lines, order = {}, {}
for line in (source .. '\n'):gmatch('([^\n]*)\n') do
  lines[#lines + 1] = line
end
for line in pairs(counts) do
  order[#order + 1] = line
end
table.sort(order, function(a, b) return counts[a] > counts[b] end)
local per_pair = calls * pairs_per_call
print(string.format('VM instructions per reserve+settle pair: %.0f', total / per_pair))
for i = 1, math.min(#order, shown) do
  local line = order[i]
  print(string.format('%6.1f  %5d  %s', counts[line] / per_pair, line, lines[line]))
end
