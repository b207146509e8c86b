-- ratekeeper's limiter script, part 3 of 3: one request's checks as one step.
-- Twin of src/limiter/batch.rs; arguments are described in lua/README.md.
-- Every call pays for what it allocates here, so per check there is one
-- table (its arguments) and answers go straight into the reply.
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + idiv(tonumber(t[2]), 1000)
else
  now = tonumber(ARGV[1])
end
local all_or_nothing = ARGV[2] == '1'
local FIELDS = 6

-- Per key: the live state (after this request's hits so far) and the
-- last check that consumed from it.
local live, consumed_by = {}, {}
local checks, out = {}, {}
local blocked = false
for i = 1, #KEYS do
  local a = 3 + (i - 1) * FIELDS
  local hits = tonumber(ARGV[a + 4])
  local c = {
    tag = ARGV[a],
    limit = tonumber(ARGV[a + 1]),
    period = tonumber(ARGV[a + 2]),
    burst = tonumber(ARGV[a + 3]),
    hits = hits,
    need = math.max(hits, 1),
  }
  checks[i] = c
  local algo = algorithm(c.tag)
  local key = KEYS[i]
  local s = live[key]
  if s == nil then
    s = algo.load(key, c, now)
    live[key] = s
  end
  local over = algo.is_over(s, c, now)
  if over and ARGV[a + 5] == '1' then
    blocked = true
  end
  local applied = (not over) and hits > 0
  if applied then
    algo.apply(s, c, now)
    consumed_by[key] = i
  end
  local remaining, reset = algo.report(s, c, over, applied, now)
  out[3 * i - 2] = over and 1 or 0
  out[3 * i - 1] = remaining
  out[3 * i] = reset
end

if blocked and all_or_nothing then
  -- A refused request consumes nothing: report the stored states, loaded
  -- again (nothing was written; refusals are the rarer case, so this beats
  -- copying every state up front).
  local stored = {}
  for i = 1, #KEYS do
    local c, key = checks[i], KEYS[i]
    local algo = algorithm(c.tag)
    local s = stored[key]
    if s == nil then
      s = algo.load(key, c, now)
      stored[key] = s
    end
    out[3 * i - 1], out[3 * i] = algo.report(s, c, out[3 * i - 2] == 1, false, now)
  end
else
  for key, i in pairs(consumed_by) do
    local c = checks[i]
    local algo = algorithm(c.tag)
    algo.save(key, live[key], c, now, math.max(algo.ttl(live[key], c, now), 1))
  end
end
return out
