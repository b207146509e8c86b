-- fixed_window: one counter per window aligned to the Unix epoch.
-- Twin of src/limiter/fixed_window.rs. Value: hash {w = window, c = count}.
B.fw = function()
  local function fw_save(key, s, c, now, ttl)
    if s.same_window then
      -- The save that began this window set the key to expire at its end.
      redis.call('HSET', key, 'c', int(s.count))
    else
      redis.call('HSET', key, 'w', int(s.window), 'c', int(s.count))
      redis.call('PEXPIRE', key, int(ttl))
    end
  end

  return {
    load = function(key, c, now)
      local window = idiv(now, c.period)
      local h = redis.call('HMGET', key, 'w', 'c')
      if tonumber(h[1]) == window then
        return { window = window, count = tonumber(h[2]), same_window = true }
      end
      return { window = window, count = 0 }
    end,
    is_over = function(s, c, now)
      return s.count + c.need > c.limit
    end,
    apply = function(s, c, now)
      -- Every hit counts, past the limit too, with no bound on the debt (the
      -- window's end clears it); the cap only keeps the count exact. Twin of
      -- Window::apply and MAX_COUNT in src/limiter/fixed_window.rs.
      local count = s.count + c.hits
      if count > 4503599627370496 then
        count = 4503599627370496
      end
      s.count = count
    end,
    report = function(s, c, over, applied, now)
      return math.max(c.limit - s.count, 0), (s.window + 1) * c.period - now
    end,
    ttl = function(s, c, now)
      return (s.window + 1) * c.period - now
    end,
    -- Gives back hits of a reservation made at `at` (lua/budget.lua): only
    -- in its window (a window that has passed no longer matters), not below 0.
    refund = function(s, c, hits, at, mark, now)
      if idiv(at, c.period) == s.window then
        s.count = s.count - math.min(hits, s.count)
      end
    end,
    save = fw_save,
    -- `refund` of a reservation made in the current window in one command,
    -- not a read and a write (lua/budget.lua): the state after it, or nil
    -- when the reservation's window has passed (the general path then reads
    -- the key, and `refund` gives nothing back). A count that falls below 0
    -- (the key was reset since, or this HINCRBY made it) is saved as
    -- `refund` leaves it: 0, expiring with the window.
    refund_in_window = function(key, c, hits, at, now)
      local window = idiv(now, c.period)
      if idiv(at, c.period) ~= window then
        return nil
      end
      local s = { window = window, count = redis.call('HINCRBY', key, 'c', int(-hits)), same_window = true }
      if s.count < 0 then
        s.count, s.same_window = 0, nil
        fw_save(key, s, c, now, (window + 1) * c.period - now)
      end
      return s
    end,
  }
end
