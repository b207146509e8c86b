-- ratekeeper's budget reservations (issue #23: reserve, then settle). Twin
-- of src/limiter/budget.rs and the markers of src/store/memory.rs; joined
-- after prelude.lua and the algorithm files, like batch.lua, as the second
-- function of the limiter's library (or a script of its own where Redis
-- has no functions): lua/README.md.
--
-- A call carries one or more operations, decided one after another, each
-- its own atomic step (as batch.lua decides requests), so that concurrent
-- Reserves and Settles share a call (src/store/batcher.rs). An operation's
-- keys are in one hash slot (on a cluster a call carries one operation).
-- ARGV[1] now in ms or "" for the server's TIME. Then per operation, in
-- order: in KEYS the reservation's marker in this slot, then the counter
-- keys of its checks in this slot, in order (n of them); in ARGV a header
-- "<op> <n> <amount>", the counter keys of the whole reservation (every
-- slot's), one a line, then for reserve and check each check's fields.
--   reserve: amount = TTL in ms; the fields as batch.lua takes them
--            (hits = the estimate; charges are ignored).
--            -> {granted 1|0, then over, remaining, reset_ms per check}
--   check:   as reserve, but takes nothing and records nothing: the
--            outcomes of a refused reservation (for the slots a cluster
--            reservation did not reach once one slot refused).
--   settle:  amount = the actual cost.
--            -> {0 unknown | 1 settled now | 2 settled before, the actual
--            it is settled at, then over, remaining, reset_ms per check,
--            the standing after the settlement}
-- The reply: per operation the length of its answer, then the answer. An
-- operation whose fields (answer {-1, 1}) or marker ({-1, 2}) are
-- malformed does nothing; the others of the call stand.
-- The marker, a hash expiring with the reservation: s = "" while pending,
-- else the actual it was settled at; at = the time of the reservation (ms);
-- k = its counter keys (the whole reservation's), sk = this slot's, c =
-- this slot's checks' fields, one a line; m = the mark of each check (what
-- the algorithm's `reserve` returned; "-" when it took nothing), separated
-- by spaces. A settle trusts only the marker, and only when it names
-- exactly the keys the settle does: another reservation's keys, or a part
-- of them, touch nothing.

-- A count argument as a number; nil when it is not one.
local function count(arg)
  if arg ~= nil and string.match(arg, '^%d+$') then
    return tonumber(arg)
  end
  return nil
end

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + idiv(tonumber(t[2]), 1000)
else
  now = count(ARGV[1])
end
if now == nil then
  return redis.error_reply('ERR malformed budget arguments')
end

-- A check like c but for `hits` (a new table: check_of's are shared).
local function with_hits(c, hits, charges)
  return {
    tag = c.tag, algo = c.algo, limit = c.limit, period = c.period, burst = c.burst,
    hits = hits, need = math.max(hits, 1), enforce = c.enforce, charges = charges,
  }
end

-- Puts each check's standing (one more hit over? what is left, the reset)
-- into out from index 3, consuming nothing. keys: the marker, then the
-- checks' counter keys.
local function standing(keys, checks, out)
  for i, c in ipairs(checks) do
    local probe = with_hits(c, 0, false)
    local s = c.algo.load(keys[i + 1], probe, now)
    local over = c.algo.is_over(s, probe, now)
    local o = 3 * i
    out[o] = over and 1 or 0
    out[o + 1], out[o + 2] = c.algo.report(s, probe, over, false, now)
  end
  return out
end

-- reserve (or check, when `only_check`): keys as for standing, fields each
-- check's, all_keys the whole reservation's counter keys.
local function reserve(keys, fields, ttl, all_keys, only_check)
  local n = #fields
  -- Per key: its state, the check to save it with, the reservation's mark.
  local checks, state, save_with, taken, marks = {}, {}, {}, {}, {}
  local out, blocked = { 1 }, only_check
  for i = 1, n do
    local c, key = check_of(fields[i]), keys[i + 1]
    if c == nil then
      return { -1, 1 }
    end
    checks[i] = c
    local algo, s = c.algo, state[key]
    if s == nil then
      s = algo.load(key, c, now)
      state[key] = s
    end
    local over = algo.is_over(s, c, now)
    if over and c.enforce then
      blocked = true
    end
    local applied = c.hits > 0 and not over
    marks[i] = '-'
    if applied then
      -- The reservation's hits on a key are one entry: the key's first
      -- check makes it, the others join it.
      local mark = taken[key]
      if mark ~= nil then
        algo.apply(s, c, now)
      elseif algo.reserve ~= nil then
        mark = algo.reserve(s, c, now)
      else
        algo.apply(s, c, now)
        mark = 0
      end
      taken[key], marks[i], save_with[key] = mark, int(mark), c
    end
    local o = 3 * i
    out[o - 1] = over and 1 or 0
    out[o], out[o + 1] = algo.report(s, c, over, applied, now)
  end
  if blocked then
    -- Refused: nothing was saved; each check is reported against its
    -- state as stored, like a refused all-or-nothing request's.
    state = {}
    for i, c in ipairs(checks) do
      local key = keys[i + 1]
      local s = state[key] or c.algo.load(key, c, now)
      state[key] = s
      local o = 3 * i
      out[o], out[o + 1] = c.algo.report(s, c, out[o - 1] == 1, false, now)
    end
    out[1] = 0
    return out
  end
  for key, c in pairs(save_with) do
    local s, algo = state[key], c.algo
    algo.save(key, s, c, now, math.max(algo.ttl(s, c, now), 1))
  end
  redis.call('HSET', keys[1], 's', '', 'at', int(now), 'k', all_keys,
    'sk', table.concat(keys, '\n', 2), 'c', table.concat(fields, '\n'),
    'm', table.concat(marks, ' '))
  redis.call('PEXPIRE', keys[1], int(math.max(ttl, 1)))
  return out
end

local function settle(keys, actual, all_keys)
  local n = #keys - 1
  local h = redis.call('HMGET', keys[1], 's', 'at', 'k', 'c', 'm', 'sk')
  if h[3] ~= all_keys or h[6] ~= table.concat(keys, '\n', 2) then
    return { 0, 0 }
  end
  local checks, marks = {}, {}
  for fields in string.gmatch(h[4], '[^\n]+') do
    checks[#checks + 1] = check_of(fields)
  end
  for mark in string.gmatch(h[5], '%S+') do
    marks[#marks + 1] = tonumber(mark) or false
  end
  if #checks ~= n or #marks ~= n then
    return { -1, 2 }
  end
  if h[1] ~= '' then
    return standing(keys, checks, { 2, tonumber(h[1]) })
  end
  local at = tonumber(h[2])
  for i, c in ipairs(checks) do
    if marks[i] and actual ~= c.hits then
      local key, algo = keys[i + 1], c.algo
      local s = algo.load(key, c, now)
      if actual < c.hits then
        algo.refund(s, c, c.hits - actual, at, marks[i], now)
      else
        algo.apply(s, with_hits(c, actual - c.hits, true), now)
      end
      algo.save(key, s, c, now, math.max(algo.ttl(s, c, now), 1))
    end
  end
  redis.call('HSET', keys[1], 's', int(actual))
  return standing(keys, checks, { 1, actual })
end

-- The operations' framing, all read before any is made: a call whose
-- framing is wrong (a header, the number of keys or of fields) does nothing.
local ops, k, a = {}, 1, 2
while a <= #ARGV do
  local op, n, amount = string.match(ARGV[a], '^(%l+) (%d+) (%d+)$')
  n, amount = tonumber(n), tonumber(amount)
  local settling = op == 'settle'
  local nf = settling and 0 or n
  if op == nil or n == nil or amount == nil or n < 1 or k + n > #KEYS
    or a + 1 + nf > #ARGV or not (settling or op == 'reserve' or op == 'check') then
    return redis.error_reply('ERR malformed budget arguments')
  end
  ops[#ops + 1] = { op = op, n = n, nf = nf, amount = amount, k = k, a = a }
  k, a = k + n + 1, a + 2 + nf
end
if k ~= #KEYS + 1 or #ops == 0 then
  return redis.error_reply('ERR malformed budget arguments')
end

local out = {}
for _, o in ipairs(ops) do
  local keys, fields = {}, {}
  for i = 0, o.n do
    keys[i + 1] = KEYS[o.k + i]
  end
  for i = 1, o.nf do
    fields[i] = ARGV[o.a + 1 + i]
  end
  local answer
  if o.op == 'settle' then
    answer = settle(keys, o.amount, ARGV[o.a + 1])
  else
    answer = reserve(keys, fields, o.amount, ARGV[o.a + 1], o.op == 'check')
  end
  out[#out + 1] = #answer
  for i = 1, #answer do
    out[#out + 1] = answer[i]
  end
end
return out
