-- sliding_log: the exact timestamps of admitted hits in the last period.
-- Twin of src/limiter/sliding_log.rs. Value: sorted set, score = timestamp in
-- ms, member = "<timestamp>.<position>" (unique: within one millisecond the
-- position only grows, as nothing expires in between).
-- State: n = entries stored (after trimming), added = entries this request
-- adds, all stamped now.

-- The k-th oldest timestamp (1-based) as the state sees it.
local function sl_stamp(s, k, now)
  if k > s.n then
    return now
  end
  local r = redis.call('ZRANGE', s.key, k - 1, k - 1, 'WITHSCORES')
  return tonumber(r[2])
end

B.sl = function() return {
  load = function(key, c, now)
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - c.period))
    return { key = key, n = redis.call('ZCARD', key), added = 0 }
  end,
  is_over = function(s, c, now)
    return s.n + s.added + c.need > c.limit
  end,
  apply = function(s, c, now)
    s.added = s.added + math.min(c.hits, c.limit)
  end,
  report = function(s, c, over, applied, now)
    local count = s.n + s.added
    local stamp
    if over and c.need <= c.limit then
      -- The refused hits fit once k of the oldest have expired (or now, when
      -- reporting a stored state they fit into).
      local k = count + c.need - c.limit
      if k < 1 then
        return math.max(c.limit - count, 0), 0
      end
      stamp = sl_stamp(s, k, now)
    elseif count > 0 then
      stamp = sl_stamp(s, count, now)
    else
      return c.limit, 0
    end
    return math.max(c.limit - count, 0), stamp + c.period - now
  end,
  ttl = function(s, c, now)
    return c.period
  end,
  save = function(key, s, c, now, ttl)
    local args = {}
    for j = 1, s.added do
      args[#args + 1] = int(now)
      args[#args + 1] = int(now) .. '.' .. int(s.n + j)
      if #args >= 2000 then
        redis.call('ZADD', key, unpack(args))
        args = {}
      end
    end
    if #args > 0 then
      redis.call('ZADD', key, unpack(args))
    end
    redis.call('PEXPIRE', key, int(ttl))
  end,
} end
