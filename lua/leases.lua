-- Concurrency leases: one sorted set per limited entity, member = lease id,
-- score = expiry in ms (Redis time). Beside each set, a hash (the set's key
-- + ':holders', so the same hash tag and slot) maps a lease to the holder its
-- caller named, for the admin API's list; a lease without a holder has no
-- field. Twin of src/store/memory.rs's leases.
--
-- ARGV[1] operation, ARGV[2] now in ms or "" for the server's TIME.
--   acquire:   KEYS = the lease's sets; ARGV[3] member, ARGV[4] ttl ms,
--              ARGV[5..4+#KEYS] the limit of each set, then the holder
--              ('' or absent: none stored).
--              -> {granted, expired, retry_after_ms, active per set...}
--   heartbeat: KEYS = every lease's sets, in order; ARGV[3..] per lease:
--              member, ttl ms, number of sets. -> {1 extended | 0 lost, ...}
--   release:   KEYS as heartbeat; ARGV[3..] per lease: member, number of sets.
--   list:      KEYS[1] a set -> {member, expiry ms, holder ('' if none), ...}
--              of its unexpired leases, soonest first.
-- Every set's TTL is kept at least as long as its newest lease, and its
-- holders' hash at least as long as its newest lease with a holder, so an
-- abandoned set disappears by itself. A holder leaves the hash with its
-- lease (release, lost at heartbeat, or expired: dropped at the next acquire
-- that drops an expired lease), so the hash never outgrows the set by more
-- than the leases expired since. Nothing scans the keyspace.

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

local function holders(key)
  return key .. ':holders'
end

-- Keeps set `key` until at least `ttl` ms from now and, with `with_holders`,
-- its holders' hash too. Extending the set means every lease in it expires
-- sooner than that, so the hash can take the same TTL without asking its own
-- (a hash that does not exist stays so).
local function keep_until(key, ttl, with_holders)
  if redis.call('PTTL', key) < ttl then
    redis.call('PEXPIRE', key, int(ttl))
    if with_holders then
      redis.call('PEXPIRE', holders(key), int(ttl))
    end
  elseif with_holders then
    local left = redis.call('PTTL', holders(key))
    if left ~= -2 and left < ttl then
      redis.call('PEXPIRE', holders(key), int(ttl))
    end
  end
end

-- Drops the expired leases of set `key`, and then the holders no longer in
-- it (only then: expiries are rare next to acquires, and the common path
-- stays one call); returns how many leases.
local function drop_expired(key)
  local gone = redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
  if gone > 0 then
    for _, member in ipairs(redis.call('HKEYS', holders(key))) do
      if not redis.call('ZSCORE', key, member) then
        redis.call('HDEL', holders(key), member)
      end
    end
  end
  return gone
end

local op = ARGV[1]
if op == 'acquire' then
  local member, ttl = ARGV[3], tonumber(ARGV[4])
  local holder = ARGV[5 + #KEYS] or ''
  local active, expired, granted, retry = {}, 0, 1, 0
  for i = 1, #KEYS do
    expired = expired + drop_expired(KEYS[i])
    active[i] = redis.call('ZCARD', KEYS[i])
    if active[i] >= tonumber(ARGV[4 + i]) then
      granted = 0
      local first = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
      if first[2] then
        retry = math.max(retry, tonumber(first[2]) - now)
      end
    end
  end
  -- An acquire made again after its connection broke before the reply
  -- (src/store/caller.rs) finds its lease (ids are 128 random bits) and
  -- adds nothing: refused only by that lease, it is granted as before
  -- (asked on the refused path only); granted again, ZADD counts it once.
  -- (The in-memory twin is never asked twice: nothing lies between.)
  if granted == 0 and redis.call('ZSCORE', KEYS[1], member) then
    return { 1, expired, 0, unpack(active) }
  end
  if granted == 1 then
    for i = 1, #KEYS do
      local added = redis.call('ZADD', KEYS[i], int(now + ttl), member)
      if holder ~= '' then
        redis.call('HSET', holders(KEYS[i]), member, holder)
      end
      keep_until(KEYS[i], ttl, holder ~= '')
      active[i] = active[i] + added
    end
  end
  return { granted, expired, retry, unpack(active) }
end

if op == 'list' then
  local key, out = KEYS[1], {}
  local live = redis.call('ZRANGEBYSCORE', key, '(' .. int(now), '+inf', 'WITHSCORES')
  for j = 1, #live, 2 do
    out[#out + 1] = live[j]
    out[#out + 1] = live[j + 1]
    out[#out + 1] = redis.call('HGET', holders(key), live[j]) or ''
  end
  return out
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
        keep_until(KEYS[j], ttl, true)
      else
        redis.call('ZREM', KEYS[j], member)
        redis.call('HDEL', holders(KEYS[j]), member)
      end
    end
    out[#out + 1] = alive
    k, a = k + n, a + 3
  else
    local n = tonumber(ARGV[a + 1])
    for j = k, k + n - 1 do
      redis.call('ZREM', KEYS[j], member)
      redis.call('HDEL', holders(KEYS[j]), member)
    end
    k, a = k + n, a + 2
  end
end
return out
