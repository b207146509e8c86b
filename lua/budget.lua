-- ratekeeper's budget reservations (issue #23: reserve, then settle), in
-- one hash slot. Twin of src/limiter/budget.rs and the markers of
-- src/store/memory.rs; joined after prelude.lua and the algorithm files,
-- like batch.lua, as the second function of the limiter's library (or a
-- script of its own where Redis has no functions): lua/README.md.
--
-- KEYS[1] the reservation's marker in this slot, KEYS[2..] the counter keys
-- of its checks in this slot, in order. ARGV[1] the operation, ARGV[2] now
-- in ms or "" for the server's TIME, ARGV[4] the counter keys of the whole
-- reservation (every slot's), one a line.
--   reserve: ARGV[3] TTL in ms, ARGV[5..] each check's fields (as batch.lua
--            takes them; hits = the estimate; charges are ignored).
--            -> {granted 1|0, then over, remaining, reset_ms per check}
--   check:   as reserve, but takes nothing and records nothing: the
--            outcomes of a refused reservation (for the slots a cluster
--            reservation did not reach once one slot refused).
--   settle:  ARGV[3] the actual cost.
--            -> {0 unknown | 1 settled now | 2 settled before, the actual
--            it is settled at, then over, remaining, reset_ms per check,
--            the standing after the settlement}
-- The marker, a hash expiring with the reservation: s = "" while pending,
-- else the actual it was settled at; at = the time of the reservation (ms);
-- k = its counter keys (ARGV[4]), sk = this slot's, c = this slot's checks'
-- fields, one a line; m = the mark of
-- each check (what the algorithm's `reserve` returned; "-" when it took
-- nothing), separated by spaces. A settle trusts only the marker, and only
-- when it names exactly the keys the settle does (KEYS[2..] and ARGV[4]):
-- another reservation's keys, or a part of them, touch nothing.
-- A count argument as a number; nil when it is not one.
local function count(arg)
  if arg ~= nil and string.match(arg, '^%d+$') then
    return tonumber(arg)
  end
  return nil
end

local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + idiv(tonumber(t[2]), 1000)
else
  now = count(ARGV[2])
end
local op, n = ARGV[1], #KEYS - 1
-- This slot's counter keys, one a line.
local function slot_keys()
  local keys = {}
  for i = 1, n do
    keys[i] = KEYS[i + 1]
  end
  return table.concat(keys, '\n')
end

local function malformed()
  return redis.error_reply('ERR malformed budget arguments')
end
if now == nil then
  return malformed()
end

-- A check like c but for `hits` (a new table: check_of's are shared).
local function with_hits(c, hits, charges)
  return {
    tag = c.tag, algo = c.algo, limit = c.limit, period = c.period, burst = c.burst,
    hits = hits, need = math.max(hits, 1), enforce = c.enforce, charges = charges,
  }
end

-- Puts each check's standing (one more hit over? what is left, the reset)
-- into out from index 3, consuming nothing.
local function standing(checks, out)
  for i, c in ipairs(checks) do
    local probe = with_hits(c, 0, false)
    local s = c.algo.load(KEYS[i + 1], probe, now)
    local over = c.algo.is_over(s, probe, now)
    local o = 3 * i
    out[o] = over and 1 or 0
    out[o + 1], out[o + 2] = c.algo.report(s, probe, over, false, now)
  end
  return out
end

if op == 'reserve' or op == 'check' then
  local ttl = count(ARGV[3])
  if ttl == nil or n < 1 or #ARGV ~= 4 + n then
    return malformed()
  end
  -- Per key: its state, the check to save it with, the reservation's mark.
  local checks, state, save_with, taken, marks = {}, {}, {}, {}, {}
  local out, blocked = { 1 }, op == 'check'
  for i = 1, n do
    local c, key = check_of(ARGV[4 + i]), KEYS[i + 1]
    if c == nil then
      return malformed()
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
      local key = KEYS[i + 1]
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
  redis.call('HSET', KEYS[1], 's', '', 'at', int(now), 'k', ARGV[4], 'sk', slot_keys(),
    'c', table.concat(ARGV, '\n', 5), 'm', table.concat(marks, ' '))
  redis.call('PEXPIRE', KEYS[1], int(math.max(ttl, 1)))
  return out
end

if op ~= 'settle' then
  return malformed()
end
local actual = count(ARGV[3])
if actual == nil or n < 1 or #ARGV ~= 4 then
  return malformed()
end
local h = redis.call('HMGET', KEYS[1], 's', 'at', 'k', 'c', 'm', 'sk')
if h[3] ~= ARGV[4] or h[6] ~= slot_keys() then
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
  return redis.error_reply('ERR malformed budget marker')
end
if h[1] ~= '' then
  return standing(checks, { 2, tonumber(h[1]) })
end
local at = tonumber(h[2])
for i, c in ipairs(checks) do
  if marks[i] and actual ~= c.hits then
    local key, algo = KEYS[i + 1], c.algo
    local s = algo.load(key, c, now)
    if actual < c.hits then
      algo.refund(s, c, c.hits - actual, at, marks[i], now)
    else
      algo.apply(s, with_hits(c, actual - c.hits, true), now)
    end
    algo.save(key, s, c, now, math.max(algo.ttl(s, c, now), 1))
  end
end
redis.call('HSET', KEYS[1], 's', int(actual))
return standing(checks, { 1, actual })
