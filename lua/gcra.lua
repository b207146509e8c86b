-- token_bucket and leaky_bucket: GCRA, one theoretical arrival time (TAT) per
-- key, in integer microseconds. Twin of src/limiter/gcra.rs. Value: string TAT.

-- A key's give-backs (lua/budget.lua's settles): `<key>:given`, their total
-- in µs of TAT, and `<key>:given.log`, the latest GIVEN_BACK_LOG of them by
-- mark (score the mark, member "<µs>:<total after it>"). A reservation's
-- mark is read against the total, so both live as long as any reservation
-- on the key may settle: each reservation makes the total (0) if there is
-- none and keeps both its TTL and GIVEN_BACK_GRACE_MS more, never less
-- than they had. (A fixed two hours past every reservation left the pair
-- behind long after its bucket, some 0.7 KB of Redis per bucket given
-- back to.) A total found without an expiry, from a reservation of an
-- earlier version, gets GIVEN_BACK_KEEP_MS. Twins: src/limiter/budget.rs.
-- A mark (TAT + total) is a double here: past 2^53 µs (some 200 years of
-- give-backs on a key never left alone) it rounds to 2 µs and more, where
-- the Rust twin stays exact.
local GIVEN_BACK_GRACE_MS, GIVEN_BACK_KEEP_MS, GIVEN_BACK_LOG = 60000, 7200000, 64

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
  -- A reservation's hits (lua/budget.lua), which may settle for `ttl` ms.
  -- Its mark is where they end, in a coordinate give-backs do not move: the
  -- TAT they left (hits are served in order, so they are drained by then)
  -- plus all the key's settles had given back so far; the give-backs are
  -- kept as long as it may settle.
  reserve = function(s, c, now, key, ttl)
    gcra_apply(s, c, now)
    local total = redis.call('GET', key .. ':given')
    s.given = tonumber(total) or 0
    -- Kept by `save`, which only a granted reservation reaches.
    s.keep_given, s.given_found = ttl + GIVEN_BACK_GRACE_MS, total ~= false
    return s.tat + s.given
  end,
  -- A later check of the same reservation on the key: its mark is where its
  -- own hits end (twin of Policy::join).
  join = function(s, c, now)
    gcra_apply(s, c, now)
    return s.tat + s.given
  end,
  -- Gives back hits of a reservation: the TAT moves back by their emission,
  -- but only by what of the reservation has not drained yet (what drained
  -- was spent), and not before now. Its hits end at its mark less all given
  -- back, but for the give-backs behind it (a later mark), which moved
  -- nothing of its; what this one gives back joins them.
  refund = function(s, c, hits, at, mark, now, key)
    local given = key .. ':given'
    local log = given .. '.log'
    local ends = mark
    local total = tonumber(redis.call('GET', given))
    if total then
      ends = mark - total
      local behind = redis.call('ZRANGEBYSCORE', log, '(' .. int(mark), '+inf')
      for i = 1, #behind do
        ends = ends + tonumber(string.match(behind[i], '^%d+'))
      end
    end
    local back = math.min(hits * gcra_emission(c), math.max(ends - now * 1000, 0))
    local tat = math.max(s.tat - back, now * 1000)
    if tat < s.tat then
      local us = int(s.tat - tat)
      local after = redis.call('INCRBY', given, us)
      -- The total's life is the reservations' (see above), the log's too.
      local keep = redis.call('PTTL', given)
      if keep < 0 then
        keep = GIVEN_BACK_KEEP_MS
        redis.call('PEXPIRE', given, keep)
      end
      redis.call('ZADD', log, int(mark), us .. ':' .. int(after))
      redis.call('ZREMRANGEBYRANK', log, 0, -(GIVEN_BACK_LOG + 1))
      redis.call('PEXPIRE', log, keep)
      s.tat = tat
    end
  end,
  save = function(key, s, c, now, ttl)
    redis.call('SET', key, int(s.tat), 'PX', int(ttl))
    local keep = s.keep_given
    if keep ~= nil then
      -- A granted reservation's give-backs (see `reserve`).
      local given = key .. ':given'
      if not s.given_found then
        redis.call('SET', given, '0', 'PX', int(keep))
      elseif redis.call('PTTL', given) < keep then
        redis.call('PEXPIRE', given, int(keep))
        redis.call('PEXPIRE', given .. '.log', int(keep))
      end
    end
  end,
} end
B.tb = gcra
B.lb = gcra
