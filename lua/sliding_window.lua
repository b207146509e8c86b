-- sliding_window: current + previous window counts, the previous weighted by
-- its overlap with the sliding window (rounded down).
-- Twin of src/limiter/sliding_window.rs. Value: hash {w, c = current, p = previous}.
local function sw_estimate(s, c, now)
  local elapsed = now - s.window * c.period
  -- Same float operations, in the same order, as the Rust twin.
  return math.floor(s.previous * (c.period - elapsed) / c.period) + s.current
end

B.sw = function() return {
  load = function(key, c, now)
    local window = idiv(now, c.period)
    local h = redis.call('HMGET', key, 'w', 'c', 'p')
    local w = tonumber(h[1])
    if w == window then
      return {
        window = window, current = tonumber(h[2]), previous = tonumber(h[3]), same_window = true,
      }
    elseif w == window - 1 then
      return { window = window, current = 0, previous = tonumber(h[2]) }
    end
    return { window = window, current = 0, previous = 0 }
  end,
  is_over = function(s, c, now)
    return sw_estimate(s, c, now) + c.need > c.limit
  end,
  apply = function(s, c, now)
    s.current = s.current + charge(c, sw_estimate(s, c, now))
  end,
  report = function(s, c, over, applied, now)
    return math.max(c.limit - sw_estimate(s, c, now), 0), (s.window + 1) * c.period - now
  end,
  ttl = function(s, c, now)
    return (s.window + 2) * c.period - now
  end,
  -- Gives back hits of a reservation made at `at` (lua/budget.lua) from the
  -- window it counted in: the current one or the previous one; not below 0.
  refund = function(s, c, hits, at, mark, now)
    local window = idiv(at, c.period)
    if window == s.window then
      s.current = s.current - math.min(hits, s.current)
    elseif window + 1 == s.window then
      s.previous = s.previous - math.min(hits, s.previous)
      -- Saved whole, then: a save within the window writes only c.
      s.same_window = nil
    end
  end,
  save = function(key, s, c, now, ttl)
    if s.same_window then
      -- The save that began this window set the key's expiry; p is as saved.
      redis.call('HSET', key, 'c', int(s.current))
    else
      redis.call('HSET', key, 'w', int(s.window), 'c', int(s.current), 'p', int(s.previous))
      redis.call('PEXPIRE', key, int(ttl))
    end
  end,
} end
