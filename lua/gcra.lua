-- token_bucket and leaky_bucket: GCRA, one theoretical arrival time (TAT) per
-- key, in integer microseconds. Twin of src/limiter/gcra.rs. Value: string TAT.

-- How long a key's given-back total (`<key>:given`, lua/budget.lua's
-- settles) outlives the last reservation that read it or settle that added
-- to it: past any reservation's TTL and a Cluster's grace. Twin of
-- GIVEN_BACK_KEEP_MS in src/limiter/budget.rs.
local GIVEN_BACK_KEEP_MS = 7200000

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
  -- A reservation's hits (lua/budget.lua); the mark is the TAT they left
  -- (hits are served in order, so they are drained by then) plus what the
  -- key's settles had given back so far, kept as long as the reservation
  -- may settle.
  reserve = function(s, c, now, key)
    gcra_apply(s, c, now)
    local given = key .. ':given'
    local total = redis.call('GET', given)
    if not total then
      return s.tat
    end
    redis.call('PEXPIRE', given, GIVEN_BACK_KEEP_MS)
    return s.tat + tonumber(total)
  end,
  -- Gives back hits of a reservation: the TAT moves back by their emission,
  -- but only by what of the reservation has not drained yet (what drained
  -- was spent), and not before now. Where its hits end now: the mark less
  -- all given back on the key since (a give-back ahead of them moved them
  -- forward); what this one gives back joins that total.
  refund = function(s, c, hits, at, mark, now, key)
    local given = key .. ':given'
    local ends = mark - (tonumber(redis.call('GET', given)) or 0)
    local back = math.min(hits * gcra_emission(c), math.max(ends - now * 1000, 0))
    local tat = math.max(s.tat - back, now * 1000)
    if tat < s.tat then
      redis.call('INCRBY', given, int(s.tat - tat))
      redis.call('PEXPIRE', given, GIVEN_BACK_KEEP_MS)
      s.tat = tat
    end
  end,
  save = function(key, s, c, now, ttl)
    redis.call('SET', key, int(s.tat), 'PX', int(ttl))
  end,
} end
B.tb = gcra
B.lb = gcra
