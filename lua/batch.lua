-- ratekeeper's limiter script, part 3 of 3: requests' checks, each request
-- one step. Twin of src/limiter/batch.rs; arguments in lua/README.md.
-- One call may carry several requests (joined by src/store/batcher.rs):
-- they are decided one after another, each all-or-nothing on its own, and
-- each sees what the ones before it wrote.
-- Every call pays for what it allocates here, so per check there is one
-- table (its arguments) and answers go straight into the reply.
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + idiv(tonumber(t[2]), 1000)
else
  now = tonumber(ARGV[1])
end
local FIELDS = 6
local out = {}

-- Decides the checks KEYS[k0 + 1 .. k0 + n], whose fields start at ARGV[a0].
local function request(k0, a0, n, all_or_nothing)
  -- Per key: the live state (after this request's hits so far) and the
  -- last check that consumed from it.
  local live, consumed_by = {}, {}
  local checks = {}
  local blocked = false
  for i = 1, n do
    local a = a0 + (i - 1) * FIELDS
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
    local key = KEYS[k0 + i]
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
    local o = 3 * (k0 + i)
    out[o - 2] = over and 1 or 0
    out[o - 1] = remaining
    out[o] = reset
  end

  if blocked and all_or_nothing then
    -- A refused request consumes nothing: report the stored states, loaded
    -- again (nothing was written; refusals are the rarer case, so this
    -- beats copying every state up front).
    local stored = {}
    for i = 1, n do
      local c, key = checks[i], KEYS[k0 + i]
      local algo = algorithm(c.tag)
      local s = stored[key]
      if s == nil then
        s = algo.load(key, c, now)
        stored[key] = s
      end
      local o = 3 * (k0 + i)
      out[o - 1], out[o] = algo.report(s, c, out[o - 2] == 1, false, now)
    end
  else
    for key, i in pairs(consumed_by) do
      local c = checks[i]
      local algo = algorithm(c.tag)
      algo.save(key, live[key], c, now, math.max(algo.ttl(live[key], c, now), 1))
    end
  end
end

-- Each request: all-or-nothing flag, number of checks, then its checks.
local k, a, argc = 0, 2, #ARGV
while a <= argc do
  local n = tonumber(ARGV[a + 1])
  if n == nil or k + n > #KEYS then
    return redis.error_reply('malformed limiter arguments')
  end
  request(k, a + 2, n, ARGV[a] == '1')
  k = k + n
  a = a + 2 + n * FIELDS
end
return out
