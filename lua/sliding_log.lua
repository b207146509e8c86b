-- sliding_log: the admitted requests of the last period, each with its time
-- and its hits. Twin of src/limiter/sliding_log.rs. Value: one sorted set,
-- score = time in ms, one member per call that admitted hits on the key:
-- "<running total of hits through this entry, 16 digits>:<its hits>".
-- A request of a million hits is one member, so no call's work or memory
-- grows with its hits. The running total makes members unique (it only
-- grows) and puts entries of one millisecond in the order they came (the
-- zero padding makes the members' order the totals' order); the hits in the
-- period are the newest entry's total minus the one before the oldest entry
-- still in the period, so nothing is summed or scanned. Times never
-- decrease: an entry is stamped no earlier than the newest one.
-- State: g = entries aged out but not yet removed (they sit first; counted
-- only when some are in the period), base = the running total before the
-- oldest entry in the period, top = through the newest stored entry,
-- total = hits stored in the period, last = the newest stored time (nil
-- when empty), added = hits this call adds.

-- The helpers are made inside the builder, so that a script call using no
-- sliding log does not make them (lua/prelude.lua).
B.sl = function()
  -- Aged-out entries removed per call at most: a key idle for a period after
  -- a million requests then drops them over many calls rather than stalling
  -- Redis in one. What is left counts for nothing (it lies before base) and
  -- goes with the key's TTL at the latest.
  local SL_TRIM = 64
  -- Running totals are rebased (the entries in the period rewritten from 0)
  -- before they would pass this, so that they stay exact in Lua's doubles:
  -- at most once per 2^52 admitted hits, as a key's total is at most twice
  -- its limit (< 2^33, lua/prelude.lua's `charge`) just after a rebase.
  local SL_REBASE = 2 ^ 52

  -- A member's running total and hits, and its time.
  local function sl_entry(r)
    local m = r[1]
    return tonumber(string.sub(m, 1, 16)), tonumber(string.sub(m, 18)), tonumber(r[2])
  end

  local function sl_member(total, hits)
    return string.format('%016d:%d', total, hits)
  end

  -- When this call's entry is stamped: a reservation's when it was made.
  local function sl_stamp(s, now)
    if s.stamp ~= nil then
      return s.stamp
    elseif s.last ~= nil and s.last > now then
      return s.last
    end
    return now
  end

  -- The time of the oldest stored entry through which `excess` hits of the
  -- period had been admitted, by bisection over the entries in the period.
  local function sl_find(s, excess)
    local lo, hi = s.g, redis.call('ZCARD', s.key) - 1
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      local total = sl_entry(redis.call('ZRANGE', s.key, mid, mid))
      if total - s.base >= excess then
        hi = mid
      else
        lo = mid + 1
      end
    end
    local _, _, t = sl_entry(redis.call('ZRANGE', s.key, lo, lo, 'WITHSCORES'))
    return t
  end

  -- Rewrites the entries in the period with running totals from 0 and drops
  -- the aged-out ones; returns the new top.
  local function sl_rebase(s)
    local live = {}
    if s.total > 0 then
      live = redis.call('ZRANGE', s.key, s.g, -1, 'WITHSCORES')
    end
    redis.call('DEL', s.key)
    local args = {}
    for i = 1, #live, 2 do
      local total, hits, t = sl_entry({ live[i], live[i + 1] })
      args[#args + 1] = int(t)
      args[#args + 1] = sl_member(total - s.base, hits)
      if #args >= 2000 then
        redis.call('ZADD', s.key, unpack(args))
        args = {}
      end
    end
    if #args > 0 then
      redis.call('ZADD', s.key, unpack(args))
    end
    return s.top - s.base
  end

  return {
    load = function(key, c, now)
      local s = { key = key, g = 0, base = 0, top = 0, total = 0, added = 0 }
      local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
      if newest[1] == nil then
        return s
      end
      local top, _, last = sl_entry(newest)
      s.top, s.base, s.last = top, top, last
      local cutoff = now - c.period
      if last <= cutoff then
        -- All aged out: nothing in the period.
        redis.call('ZREMRANGEBYRANK', key, 0, SL_TRIM - 1)
        return s
      end
      local total, hits, t = sl_entry(redis.call('ZRANGE', key, 0, 0, 'WITHSCORES'))
      if t <= cutoff then
        local first = total - hits
        total, hits = sl_entry(redis.call('ZRANGEBYSCORE', key, '(' .. int(cutoff), '+inf',
          'WITHSCORES', 'LIMIT', 0, 1))
        -- Each entry holds at least one hit, so the hits that aged out bound
        -- the entries to remove.
        if total - hits - first <= SL_TRIM then
          redis.call('ZREMRANGEBYSCORE', key, '-inf', int(cutoff))
        else
          local g = redis.call('ZCOUNT', key, '-inf', int(cutoff))
          local drop = math.min(g, SL_TRIM)
          redis.call('ZREMRANGEBYRANK', key, 0, drop - 1)
          s.g = g - drop
        end
      end
      s.base = total - hits
      s.total = top - s.base
      return s
    end,
    is_over = function(s, c, now)
      return s.total + s.added + c.need > c.limit
    end,
    apply = function(s, c, now)
      s.added = s.added + charge(c, s.total + s.added)
    end,
    report = function(s, c, over, applied, now)
      local count = s.total + s.added
      -- A recorded charge waits for the next hit; a refused request for its own.
      local need = c.need
      if applied then
        need = 1
      end
      local stamp
      if over and need <= c.limit then
        -- The refused hits fit once `excess` of the oldest have aged out (or
        -- now, when reporting a stored state they fit into).
        local excess = count + need - c.limit
        if excess < 1 then
          return math.max(c.limit - count, 0), 0
        elseif excess > s.total then
          stamp = sl_stamp(s, now)
        else
          stamp = sl_find(s, excess)
        end
      elseif s.added > 0 then
        stamp = sl_stamp(s, now)
      elseif count > 0 then
        stamp = s.last
      else
        return c.limit, 0
      end
      return math.max(c.limit - count, 0), stamp + c.period - now
    end,
    -- A period from this call's entry, which may be stamped after now (a
    -- reservation's, or after the clock stepped back).
    ttl = function(s, c, now)
      return math.max(c.period, sl_stamp(s, now) + c.period - now)
    end,
    -- A reservation's hits (lua/budget.lua) are an entry of their own,
    -- stamped after every entry before it (a millisecond after the newest,
    -- should that be now or later), so that its time alone finds it again
    -- whatever refunds or rebases do to the totals: the first member of
    -- that score. The mark is that time.
    reserve = function(s, c, now)
      s.added = s.added + charge(c, s.total + s.added)
      if s.stamp == nil then
        s.stamp = now
        if s.last ~= nil and s.last >= now then
          s.stamp = s.last + 1
        end
      end
      return s.stamp
    end,
    -- Takes hits off the reservation's entry and off the running totals of
    -- every later one: the work grows with the entries admitted since the
    -- reservation, never with hits. An entry that aged out, or is not
    -- found, gives nothing back (the safe side); one left with no hits goes.
    -- Works on the stored set: s is not brought up to date, and
    -- lua/budget.lua loads the key again to report (refund_stores_only).
    refund_stores_only = true,
    refund = function(s, c, hits, at, mark, now)
      if mark + c.period <= now then
        return
      end
      local first = redis.call('ZRANGEBYSCORE', s.key, int(mark), int(mark), 'LIMIT', 0, 1)
      if first[1] == nil then
        return
      end
      local rank = redis.call('ZRANK', s.key, first[1])
      local later = redis.call('ZRANGE', s.key, rank, -1, 'WITHSCORES')
      local ttl = redis.call('PTTL', s.key)
      redis.call('ZREMRANGEBYRANK', s.key, rank, -1)
      local take, args = nil, {}
      for i = 1, #later, 2 do
        local total, held, t = sl_entry({ later[i], later[i + 1] })
        if take == nil then
          take = math.min(hits, held)
          held = held - take
        end
        if held > 0 then
          args[#args + 1] = int(t)
          args[#args + 1] = sl_member(total - take, held)
        end
        if #args >= 2000 or (i + 1 >= #later and #args > 0) then
          redis.call('ZADD', s.key, unpack(args))
          args = {}
        end
      end
      if ttl > 0 and redis.call('EXISTS', s.key) == 1 then
        redis.call('PEXPIRE', s.key, ttl)
      end
    end,
    save = function(key, s, c, now, ttl)
      if s.added == 0 then
        -- Charges past the debt's bound: nothing recorded (a member holds at
        -- least one hit).
        return
      end
      local top = s.top + s.added
      if top > SL_REBASE then
        top = sl_rebase(s) + s.added
      end
      redis.call('ZADD', key, int(sl_stamp(s, now)), sl_member(top, s.added))
      redis.call('PEXPIRE', key, int(ttl))
    end,
  }
end
