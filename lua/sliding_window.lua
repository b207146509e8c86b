-- sliding_window: current + previous window counts, the previous weighted by
-- its overlap with the sliding window (rounded down).
-- Twin of src/limiter/sliding_window.rs. Value: hash {w, c = current, p = previous}.
local function sw_estimate(s, c, now)
  local elapsed = now - s.window * c.period
  -- Same float operations, in the same order, as the Rust twin.
  return math.floor(s.previous * (c.period - elapsed) / c.period) + s.current
end

-- The first ms of a window at which `count` hits of the window before it,
-- weighed as sw_estimate weighs them, are at most k (Rust: first_fit).
local function sw_first_fit(count, k, period)
  if count <= k then
    return 0
  end
  return period - math.floor(((k + 1) * period - 1) / count)
end

-- Ms until `need` more hits fit, if no others come: later in this window,
-- in the next, or once both have passed (Rust: Sliding::until_fits).
local function sw_until_fits(s, c, need, now)
  local period = c.period
  local start = s.window * period
  if need <= c.limit then
    local room = c.limit - need
    if s.current <= room then
      local at = math.max(sw_first_fit(s.previous, room - s.current, period), now - start)
      if at < period then
        return start + at - now
      end
    end
    local at = sw_first_fit(s.current, room, period)
    if at < period then
      return start + period + at - now
    end
  end
  return start + 2 * period - now
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
    local reset
    if not over then
      reset = (s.window + 1) * c.period - now
    elseif applied then
      reset = sw_until_fits(s, c, 1, now)
    else
      reset = sw_until_fits(s, c, c.need, now)
    end
    return math.max(c.limit - sw_estimate(s, c, now), 0), reset
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
