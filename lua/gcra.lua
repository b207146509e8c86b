-- token_bucket and leaky_bucket: GCRA, one theoretical arrival time (TAT) per
-- key, in integer microseconds. Twin of src/limiter/gcra.rs. Value: string TAT.

-- Microseconds between two hits at the limit's rate, rounded up.
local function gcra_emission(c)
  return ceil_div(c.period * 1000, math.max(c.limit, 1))
end

local function gcra_apply(s, c, now)
  -- Admitted hits always fit under the bound: a full bucket plus a debt of
  -- one limit; a charge is cut to it (hits capped before multiplying).
  local t = gcra_emission(c)
  local room = math.max(now * 1000 + (c.burst + c.limit) * t - s.tat, 0)
  s.tat = s.tat + math.min(math.min(c.hits, c.burst + c.limit) * t, room)
end

local function gcra() return {
  load = function(key, c, now)
    local tat = tonumber(redis.call('GET', key))
    if tat ~= nil and tat > now * 1000 then
      return { tat = tat }
    end
    return { tat = now * 1000 }
  end,
  is_over = function(s, c, now)
    local t = gcra_emission(c)
    return c.limit == 0 or (s.tat - now * 1000) + c.need * t > c.burst * t
  end,
  apply = gcra_apply,
  report = function(s, c, over, applied, now)
    local t = gcra_emission(c)
    local capacity = c.burst * t
    local backlog = s.tat - now * 1000
    local remaining = 0
    if capacity > backlog then
      remaining = idiv(capacity - backlog, t)
    end
    local wait
    if over then
      -- Until the refused hits fit (a recorded charge: until one more hit
      -- does); if they never can, until empty.
      local need = c.need * t
      if applied then
        need = t
      end
      if need <= capacity then
        wait = math.max(backlog + need - capacity, 0)
      else
        wait = backlog
      end
    elseif c.tag == 'lb' and applied then
      -- The queue ahead of this request's hits.
      wait = backlog - c.hits * t
    else
      wait = backlog
    end
    return remaining, ceil_div(wait, 1000)
  end,
  ttl = function(s, c, now)
    return ceil_div(s.tat - now * 1000, 1000)
  end,
  -- A reservation's hits (lua/budget.lua); the mark is the TAT they left:
  -- hits are served in order, so they are drained by then.
  reserve = function(s, c, now)
    gcra_apply(s, c, now)
    return s.tat
  end,
  -- Gives back hits of a reservation: the TAT moves back by their emission,
  -- but only by what of the reservation has not drained yet (what drained
  -- was spent), and not before now.
  refund = function(s, c, hits, at, mark, now)
    local back = math.min(hits * gcra_emission(c), math.max(mark - now * 1000, 0))
    s.tat = math.max(s.tat - back, now * 1000)
  end,
  save = function(key, s, c, now, ttl)
    redis.call('SET', key, int(s.tat), 'PX', int(ttl))
  end,
} end
B.tb = gcra
B.lb = gcra
