-- Concurrency leases: one sorted set per limited entity, member = lease id,
-- score = expiry in ms (Redis time). Twin of src/store/memory.rs's leases.
--
-- ARGV[1] operation, ARGV[2] now in ms or "" for the server's TIME.
--   acquire:   KEYS = the lease's sets; ARGV[3] member, ARGV[4] ttl ms,
--              ARGV[5..] the limit of each set.
--              -> {granted, expired, retry_after_ms, active per set...}
--   heartbeat: KEYS = every lease's sets, in order; ARGV[3..] per lease:
--              member, ttl ms, number of sets. -> {1 extended | 0 lost, ...}
--   release:   KEYS as heartbeat; ARGV[3..] per lease: member, number of sets.
-- Every set's TTL is kept at least as long as its newest lease, so an
-- abandoned set disappears by itself. Nothing scans the keyspace.

local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(ARGV[2])
end

local function int(n)
  return string.format('%.0f', n)
end

local function keep_until(key, ttl)
  if redis.call('PTTL', key) < ttl then
    redis.call('PEXPIRE', key, int(ttl))
  end
end

local op = ARGV[1]
if op == 'acquire' then
  local member, ttl = ARGV[3], tonumber(ARGV[4])
  local active, expired, granted, retry = {}, 0, 1, 0
  for i = 1, #KEYS do
    expired = expired + redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', int(now))
    active[i] = redis.call('ZCARD', KEYS[i])
    if active[i] >= tonumber(ARGV[4 + i]) then
      granted = 0
      local first = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
      if first[2] then
        retry = math.max(retry, tonumber(first[2]) - now)
      end
    end
  end
  if granted == 1 then
    for i = 1, #KEYS do
      redis.call('ZADD', KEYS[i], int(now + ttl), member)
      keep_until(KEYS[i], ttl)
      active[i] = active[i] + 1
    end
  end
  return { granted, expired, retry, unpack(active) }
end

local out, k, a = {}, 1, 3
while a <= #ARGV do
  local member = ARGV[a]
  if op == 'heartbeat' then
    local ttl, n = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    -- Alive only if present and unexpired in every set; a lost lease is
    -- removed from all of them.
    local alive = 1
    for j = k, k + n - 1 do
      local score = redis.call('ZSCORE', KEYS[j], member)
      if not score or tonumber(score) <= now then
        alive = 0
      end
    end
    for j = k, k + n - 1 do
      if alive == 1 then
        redis.call('ZADD', KEYS[j], 'XX', int(now + ttl), member)
        keep_until(KEYS[j], ttl)
      else
        redis.call('ZREM', KEYS[j], member)
      end
    end
    out[#out + 1] = alive
    k, a = k + n, a + 3
  else
    local n = tonumber(ARGV[a + 1])
    for j = k, k + n - 1 do
      redis.call('ZREM', KEYS[j], member)
    end
    k, a = k + n, a + 2
  end
end
return out
