-- ratekeeper's limiter script, part 3 of 3: one request's checks as one step.
-- Twin of src/limiter/batch.rs; arguments are described in lua/README.md.
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + idiv(tonumber(t[2]), 1000)
else
  now = tonumber(ARGV[1])
end
local all_or_nothing = ARGV[2] == '1'
local FIELDS = 6

-- Per key: the state as stored, the live state after this request's hits,
-- and the last check that consumed from it.
local states = {}
local checks, tried = {}, {}
local blocked = false
for i = 1, #KEYS do
  local a = 3 + (i - 1) * FIELDS
  local c = {
    tag = ARGV[a],
    limit = tonumber(ARGV[a + 1]),
    period = tonumber(ARGV[a + 2]),
    burst = tonumber(ARGV[a + 3]),
    hits = tonumber(ARGV[a + 4]),
    enforce = ARGV[a + 5] == '1',
  }
  c.need = math.max(c.hits, 1)
  checks[i] = c
  local algo = A[c.tag]
  local k = states[KEYS[i]]
  if k == nil then
    local stored = algo.load(KEYS[i], c, now)
    k = { stored = stored, live = copy(stored) }
    states[KEYS[i]] = k
  end
  local over = algo.is_over(k.live, c, now)
  if over and c.enforce then
    blocked = true
  end
  local applied = (not over) and c.hits > 0
  if applied then
    algo.apply(k.live, c, now)
    k.consumed_by = i
  end
  local remaining, reset = algo.report(k.live, c, over, applied, now)
  tried[i] = { over = over, remaining = remaining, reset = reset }
end

local commit = (not blocked) or (not all_or_nothing)
if commit then
  for key, k in pairs(states) do
    if k.consumed_by then
      local c = checks[k.consumed_by]
      local ttl = math.max(A[c.tag].ttl(k.live, c, now), 1)
      A[c.tag].save(key, k.live, c, now, ttl)
    end
  end
end

local out = {}
for i = 1, #KEYS do
  local t, c = tried[i], checks[i]
  local remaining, reset = t.remaining, t.reset
  if not commit then
    -- A refused request consumed nothing: report the stored state.
    remaining, reset = A[c.tag].report(states[KEYS[i]].stored, c, t.over, false, now)
  end
  out[#out + 1] = t.over and 1 or 0
  out[#out + 1] = remaining
  out[#out + 1] = reset
end
return out
