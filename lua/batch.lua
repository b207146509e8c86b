-- ratekeeper's limiter script, part 3 of 3: requests' checks, each request
-- one step. Twin of src/limiter/batch.rs; arguments in lua/README.md.
-- One call may carry several requests (joined by src/store/batcher.rs):
-- they are decided one after another, each all-or-nothing on its own, and
-- each sees what the ones before it decided.
-- A key's state is read from Redis once per call and written back once, at
-- the end: requests of one call that share a key (one user's bursts, a
-- shared tier counter) cost Redis no more commands than one request.
-- Every call pays for what it allocates here, so a check's arguments are
-- parsed once into a table shared by all checks with the same fields
-- (`check_of`), the per-request tables are shared by all requests of the
-- call (cleared after each), and answers go straight into the reply.
-- In the function library this file is the body of the one function, whose
-- parameters are KEYS and ARGV.
-- ARGV[1] is the time, `<now ms>` or '' for the server's TIME, followed
-- by `j<ms>` when the keys this call saves get that much longer to live
-- (EXPIRATION_JITTER_MAX_SECONDS: a random number, drawn by the caller so
-- the script stays deterministic). The plain forms are tested first: they
-- are the calls without jitter, which then cost what they did before it.
local now, jitter = ARGV[1], 0
if now ~= '' and tonumber(now) == nil then
  local at, ms = string.match(now, '^(%d*)j(%d+)$')
  if ms == nil then
    return redis.error_reply('ERR malformed limiter arguments')
  end
  now, jitter = at, tonumber(ms)
end
if now == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + idiv(tonumber(t[2]), 1000)
else
  now = tonumber(now)
end
local out = {}
-- For the whole call, per key: its state as the requests decided so far
-- left it, and the check to save it with once a request consumed from it.
local state, save_with = {}, {}
-- For the request being decided, per key: the last check that consumed
-- from it, and (requests of several checks) its state before the request's
-- first hit on it, restored if the request is refused; per check, its
-- arguments.
local consumed_by, before, checks = {}, {}, {}

local function copy(s)
  local t = {}
  for field, value in pairs(s) do
    t[field] = value
  end
  return t
end

-- Decides the checks KEYS[k0 + 1 .. k0 + n], whose fields are ARGV[a0 ..
-- a0 + n - 1], as its header r says (refused: as if one of them was over);
-- false when a check's fields are malformed (the call then fails before
-- it saves anything).
local function request(k0, a0, n, r)
  local all_or_nothing = r.all_or_nothing
  local blocked = r.refused
  -- A lone check that is over consumes nothing, so only a request of
  -- several checks (or refused elsewhere) can have hits to undo.
  local single = n == 1 and not blocked
  for i = 1, n do
    local c = check_of(ARGV[a0 + i - 1])
    if c == nil then
      return false
    end
    checks[i] = c
    local algo = c.algo
    local key = KEYS[k0 + i]
    local s = state[key]
    if s == nil then
      s = algo.load(key, c, now)
      state[key] = s
    end
    local over = algo.is_over(s, c, now)
    if over and c.enforce then
      blocked = true
    end
    local applied = c.hits > 0 and (c.charges or not over)
    -- A charge over the limit: what the limit admitted before it, for the
    -- stats (the reply's over is then 2 + that; twin of
    -- Outcome::remaining_before).
    local before_charge = over and applied and algo.report(s, c, over, false, now)
    if applied then
      if not single and before[key] == nil then
        before[key] = copy(s)
      end
      algo.apply(s, c, now)
      if single then
        save_with[key] = c
      else
        consumed_by[key] = i
      end
    end
    local remaining, reset = algo.report(s, c, over, applied, now)
    local o = 3 * (k0 + i)
    out[o - 2] = before_charge and 2 + before_charge or over and 1 or 0
    out[o - 1] = remaining
    out[o] = reset
  end

  -- A lone check is its whole request: what it consumed is already marked
  -- for saving, and over its limit it consumed nothing, so there is nothing
  -- to put back. Requests are mostly one check, and the bookkeeping below
  -- cost such a request 9% of Redis's instructions on a known key and 4%
  -- on a new one (bench/lua_instructions.sh).
  if single then
    return true
  end
  local redo = blocked and all_or_nothing
  if blocked and not all_or_nothing then
    -- A when_over check that admitted hits it fitted takes them back when
    -- the request is refused, all or nothing or not (refused_records).
    for i = 1, n do
      local c = checks[i]
      if c.when_over and c.hits > 0 and out[3 * (k0 + i) - 2] == 0 then
        redo = true
        break
      end
    end
  end
  if redo then
    -- A refused request consumes only what refused_records keeps (all or
    -- nothing: its charges): put back what it took, record those hits, in
    -- order, and report each check against the state as it left it (as
    -- theirs reports each descriptor from its own INCRBY).
    for i = 1, n do
      local key = KEYS[k0 + i]
      if before[key] ~= nil then
        state[key] = before[key]
      end
    end
    -- A charge over its limit now takes over from what the charges before
    -- it left.
    for i = 1, n do
      local c, s, o = checks[i], state[KEYS[k0 + i]], 3 * (k0 + i)
      local over = out[o - 2] ~= 0
      local recorded = refused_records(c, over, all_or_nothing)
      if recorded then
        if over then
          out[o - 2] = 2 + c.algo.report(s, c, true, false, now)
        end
        c.algo.apply(s, c, now)
        save_with[KEYS[k0 + i]] = c
      end
      out[o - 1], out[o] = c.algo.report(s, c, over, recorded, now)
    end
  else
    for i = 1, n do
      local key = KEYS[k0 + i]
      if consumed_by[key] == i then
        save_with[key] = checks[i]
      end
    end
  end
  for i = 1, n do
    local key = KEYS[k0 + i]
    consumed_by[key], before[key] = nil, nil
  end
  return true
end

-- Each request: its header, then its checks' fields, one argument each.
-- A dry run (sent alone) saves nothing.
local k, a, keys, argc, dry = 0, 2, #KEYS, #ARGV, false
while a <= argc do
  local r = request_of(ARGV[a])
  if r == nil or k + r.n > keys or a + r.n > argc or not request(k, a + 1, r.n, r) then
    return redis.error_reply('ERR malformed limiter arguments')
  end
  dry = dry or r.dry
  k = k + r.n
  a = a + 1 + r.n
end
if dry then
  return cmsgpack.pack(out)
end

-- Each consumed key once, with the last check that consumed from it.
for key, c in pairs(save_with) do
  local s, algo = state[key], c.algo
  algo.save(key, s, c, now, math.max(algo.ttl(s, c, now), 1) + jitter)
end
-- The answers packed into one string: the client reads one value, not
-- three per check (src/store/packed.rs).
return cmsgpack.pack(out)
