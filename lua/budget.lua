-- ratekeeper's budget reservations (issue #23: reserve, then settle). Twin
-- of src/limiter/budget.rs and the settlements of src/store/memory.rs;
-- joined after prelude.lua and the algorithm files, like batch.lua, as the
-- second function of the limiter's library (or a script of its own where
-- Redis has no functions): lua/README.md.
--
-- A call carries one or more operations, decided one after another, each
-- its own atomic step (as batch.lua decides requests), so that concurrent
-- Reserves and Settles share a call (src/store/batcher.rs). An operation's
-- keys are in one hash slot (on a cluster a call carries one operation).
-- ARGV[1] now in ms or "" for the server's TIME. Then per operation, in
-- order: in KEYS the counter keys of its checks in this slot, in order (n
-- of them), then a settle's record bucket (a hash); in ARGV a header and
-- then each check's fields as batch.lua takes them (hits = the estimate;
-- charges are ignored).
--   reserve: header "reserve <n> <ttl ms>".
--            -> {granted 1|0, then over, remaining, reset_ms per check,
--            and when granted the time, then each check's mark (-1 when
--            it took nothing)}
--   check:   "check <n> <ttl ms>": as reserve, but takes nothing: the
--            outcomes of a refused reservation (for the slots a cluster
--            reservation did not reach once one slot refused).
--   settle:  "settle <n> <actual> <expires ms> <keep ms>", the fields,
--            then one argument of each check's reservation time and mark
--            ("<at> <mark>", '-' when it took nothing), space-separated,
--            then the reservation's nonce. Before `expires` (the
--            reservation's TTL on this Redis's clock), the first settle
--            records the actual in the bucket under the nonce (HSETNX;
--            the bucket, which ratekeeper names by the second the TTL
--            ends, lives at least to the end of the second of `expires`,
--            or `keep` ms from now when later: the first slot of several,
--            src/store/redis.rs), gives back or charges, and answers; a
--            later one (past `expires` too, while the bucket lives) finds
--            the record and changes nothing. Each key's last reset
--            (lua/reset.lua) is read in one MGET: a key reset since the
--            reservation gives nothing back (an excess is charged).
--            -> {0 unknown (expired) | 1 settled now | 2 settled before,
--            the actual it is settled at, then over, remaining, reset_ms
--            per check, the standing after the settlement}
-- Nothing is recorded at reserve: the reservation's checks, time and
-- marks travel in its id, which ratekeeper signs (src/service/id_key.rs)
-- and checks before any settle reaches Redis. A new key per pair costs
-- Redis more time than its commands count for (BENCHMARKS.md), so the one
-- record a reservation makes is its settlement's, a field in a hash that
-- the settlements of its second share (src/store/budget.rs,
-- record_bucket).
-- The reply (packed by cmsgpack, as batch.lua's): per operation the length
-- of its answer, then the answer. An operation whose fields are malformed
-- (answer {-1, 1}) does nothing; the others of the call stand.

-- A count argument as a number; nil when it is not one.
local function count(arg)
  if arg ~= nil and string.match(arg, '^%d+$') then
    return tonumber(arg)
  end
  return nil
end

-- The largest actual a settle takes (MAX_HITS).
local MAX_ACTUAL = 2 ^ 32

-- The call being made (set by budget_call, at the end): its keys and
-- arguments, its time and its answers. The helpers below read them as
-- upvalues, so that in the library they are made once, at FUNCTION LOAD,
-- not on every call (lua/README.md).
local keys, argv, now, out
-- Per key of the operation being made, at the position of its first check
-- (`first`): its state, the check to save it with, and the reservation's
-- mark on it. Shared by the operations of a call and emptied after each
-- (made afresh by each call: a call cut short by an error leaves them as
-- they were). Indexed by position, not by key: each operation's keys are
-- new to a table keyed by them, and Lua rehashes such a table every few
-- keys.
local state, save_with, taken
-- Per check of the reserve being made, its mark (-1: it took nothing).
local mark_of

-- The position of the first check among keys[k + 1 .. k + i] on the key
-- of check i (an operation's checks are few; most have distinct keys).
local function first(k, i)
  if i == 1 then
    return 1
  end
  local key = keys[k + i]
  for j = 1, i - 1 do
    if keys[k + j] == key then
      return j
    end
  end
  return i
end

-- A check like c but for `hits` (a new table: check_of's are shared).
local function with_hits(c, hits, charges)
  return {
    tag = c.tag, algo = c.algo, limit = c.limit, period = c.period, burst = c.burst,
    hits = hits, need = math.max(hits, 1), enforce = c.enforce, charges = charges,
  }
end

-- The check c with no hits, to report a standing: kept in c (check_of's
-- tables are shared and live as long as its memo; no step reads `probe`).
local function probe_of(c)
  local probe = c.probe
  if probe == nil then
    probe = with_hits(c, 0, false)
    c.probe = probe
  end
  return probe
end

-- Ends an operation on n checks: the per-key tables emptied.
local function forget(n)
  for i = 1, n do
    state[i], save_with[i], taken[i], mark_of[i] = nil, nil, nil, nil
  end
end

-- Ends an operation on n checks whose answer starts at out[p] with the
-- answer {x, y} (malformed or unknown), dropping what it wrote after;
-- returns that answer's length, 2.
local function answer2(p, n, x, y)
  for i = p + 2, p + 1 + 3 * n do
    out[i] = nil
  end
  out[p], out[p + 1] = x, y
  forget(n)
  return 2
end

-- reserve (or check, when `only_check`) of the checks keys[k + 1 .. k + n]
-- with fields argv[a + 1 .. a + n], for a reservation that may settle for
-- ttl ms. Its answer goes to out from index p; returns the answer's
-- length.
local function reserve(p, k, a, n, ttl, only_check)
  out[p] = 1
  local blocked, changed = only_check, false
  for i = 1, n do
    local c, key, f = check_of(argv[a + i]), keys[k + i], first(k, i)
    if c == nil then
      return answer2(p, n, -1, 1)
    end
    local algo, s = c.algo, state[f]
    if s == nil then
      s = algo.load(key, c, now)
      state[f] = s
    end
    local over = algo.is_over(s, c, now)
    if over and c.enforce then
      blocked = true
    end
    local applied = c.hits > 0 and not over
    local mark = -1
    if applied then
      -- The reservation's hits on a key are one entry: the key's first
      -- check makes it, the others join it (a bucket's each mark where
      -- their own hits end).
      local m = taken[f]
      if m ~= nil and algo.join ~= nil then
        m = algo.join(s, c, now)
      elseif m ~= nil then
        algo.apply(s, c, now)
      elseif algo.reserve ~= nil then
        m = algo.reserve(s, c, now, key, ttl)
      else
        algo.apply(s, c, now)
        m = 0
      end
      taken[f], save_with[f], mark = m, c, m
      changed = true
    end
    local o = p + 3 * i - 2
    out[o] = over and 1 or 0
    out[o + 1], out[o + 2] = algo.report(s, c, over, applied, now)
    mark_of[i] = mark
  end
  if blocked then
    -- Refused: nothing was saved; each check is reported against its
    -- state as stored, like a refused all-or-nothing request's (a lone
    -- check refused took nothing: its report stands).
    out[p] = 0
    if changed then
      local stored = {}
      for i = 1, n do
        local c, key = check_of(argv[a + i]), keys[k + i]
        local s = stored[key] or c.algo.load(key, c, now)
        stored[key] = s
        local o = p + 3 * i - 2
        out[o + 1], out[o + 2] = c.algo.report(s, c, out[o] == 1, false, now)
      end
    end
    forget(n)
    return 1 + 3 * n
  end
  for i = 1, n do
    local c = save_with[i]
    if c ~= nil then
      local s, algo = state[i], c.algo
      algo.save(keys[k + i], s, c, now, math.max(algo.ttl(s, c, now), 1))
    end
  end
  out[p + 3 * n + 1] = now
  for i = 1, n do
    out[p + 3 * n + 1 + i] = mark_of[i]
  end
  forget(n)
  return 2 + 4 * n
end

-- A number argument as a number: memoized, as the settles of a call
-- mostly settle reservations of one earlier call (the same time, the same
-- marks). (A closure, not memo(tonumber): the library's top, run by
-- FUNCTION LOAD, cannot reach `tonumber`.)
local number = memo(function(v)
  return tonumber(v)
end)

-- A lone check's checks, times and marks (read_reservation's answer for
-- one check).
local one_check, one_at, one_mark = {}, {}, {}

-- The checks argv[a + 1 .. a + n] of a settle and their times and marks
-- (argv[a + n + 1]: "<at> <mark>" per check, mark '-' when it took
-- nothing: false); nil when malformed.
local function read_reservation(a, n)
  local marks = argv[a + n + 1]
  if n == 1 then
    local check = check_of(argv[a + 1])
    local at, mark = string.match(marks or '', '^(%d+) (%S+)$')
    at = at and number(at)
    if check == nil or at == nil or (mark ~= '-' and not number(mark)) then
      return nil
    end
    one_check[1], one_at[1], one_mark[1] = check, at, mark ~= '-' and number(mark)
    return one_check, one_at, one_mark
  end
  local checks, ats, ms = {}, {}, {}
  for i = 1, n do
    checks[i] = check_of(argv[a + i])
    if checks[i] == nil then
      return nil
    end
  end
  for at, mark in string.gmatch(marks or '', '(%d+) (%S+)') do
    if mark ~= '-' and not number(mark) then
      return nil
    end
    ats[#ats + 1], ms[#ms + 1] = number(at), mark ~= '-' and number(mark)
  end
  if #ats ~= n then
    return nil
  end
  return checks, ats, ms
end

-- Puts each check's standing (one more hit over? what is left, the reset)
-- into out from index p + 2, consuming nothing: from the state this
-- settle left a key in, where the algorithm keeps it up to date, else as
-- stored.
local function standing(p, k, n, checks)
  for i = 1, n do
    local c = checks[i]
    local key, algo, probe = keys[k + i], c.algo, c.probe or probe_of(c)
    local s = state[first(k, i)]
    if s == nil or algo.refund_stores_only then
      s = algo.load(key, probe, now)
    end
    local over = algo.is_over(s, probe, now)
    local o = p + 3 * i - 1
    out[o] = over and 1 or 0
    out[o + 1], out[o + 2] = algo.report(s, probe, over, false, now)
  end
end

-- Makes the charge of check c on `key` (whose first check is at f) the
-- actual: gives back what the reservation took beyond it, or charges the
-- excess; from the key's state as this settle left it, else as stored.
local function settle_check(key, f, c, actual, at, mark)
  local algo, s = c.algo, state[f]
  if s == nil or algo.refund_stores_only then
    s = algo.load(key, c, now)
    state[f] = s
  end
  if actual < c.hits then
    algo.refund(s, c, c.hits - actual, at, mark, now, key)
  else
    -- The excess, charged after the fact.
    algo.apply(s, with_hits(c, actual - c.hits, true), now)
  end
  algo.save(key, s, c, now, math.max(algo.ttl(s, c, now), 1))
end

-- Each key's last reset (lua/reset.lua) of an operation on the n checks
-- keys[k + 1 .. k + n]: one command.
local function resets(k, n)
  if n == 1 then
    return { redis.call('GET', keys[k + 1] .. ':reset') }
  end
  local names = {}
  for i = 1, n do
    names[i] = keys[k + i] .. ':reset'
  end
  return redis.call('MGET', unpack(names))
end

-- Keeps the record bucket `bucket` of a settle (header o) as long as its
-- new record may be looked for: to the end of the second of o.expires, or
-- o.keep ms from now when later. Never shortened, for the records of
-- others (a cluster's bucket holds first and later slots'); rounded up
-- to the second so that the bucket's other settles find it long enough.
-- PTTL is -1 on a bucket just made.
local function keep_bucket(bucket, o)
  local need = math.max(o.expires - o.expires % 1000 + 1000 - now, o.keep)
  if redis.call('PTTL', bucket) < need then
    redis.call('PEXPIRE', bucket, int(need))
  end
end

-- settle (header o) of the checks keys[k + 1 .. k + n], fields argv[a + 1
-- .. a + n], record bucket keys[k + n + 1], nonce argv[a + n + 2]. Its
-- answer goes to out from index p; returns the answer's length.
local function settle(p, k, a, o)
  local n, actual = o.n, o.amount
  local checks, ats, marks = read_reservation(a, n)
  if checks == nil then
    return answer2(p, n, -1, 1)
  end
  -- Recorded once, while it may settle; a record found (or, past its
  -- TTL, looked for) answers as the first settle did.
  local bucket, nonce = keys[k + n + 1], argv[a + n + 2]
  if now >= o.expires or redis.call('HSETNX', bucket, nonce, o.as) == 0 then
    local v = redis.call('HGET', bucket, nonce)
    if not v then
      return answer2(p, n, 0, 0)
    end
    local earlier = tonumber(v)
    if earlier == nil then
      return answer2(p, n, -1, 1)
    end
    out[p], out[p + 1] = 2, earlier
    standing(p, k, n, checks)
    forget(n)
    return 2 + 3 * n
  end
  keep_bucket(bucket, o)
  local reset = resets(k, n)
  for i = 1, n do
    local c, at = checks[i], ats[i]
    -- A key reset since the reservation lost what it took: nothing to
    -- give back (an excess is still charged).
    local erased = reset[i] and (tonumber(reset[i]) or 0) >= at
    if marks[i] and actual ~= c.hits and not (erased and actual < c.hits) then
      local key, f, algo = keys[k + i], first(k, i), c.algo
      local s
      if actual < c.hits and algo.refund_in_window then
        s = algo.refund_in_window(key, c, c.hits - actual, at, now)
        state[f] = s or state[f]
      end
      if s == nil then
        settle_check(key, f, c, actual, at, marks[i])
      end
    end
  end
  out[p], out[p + 1] = 1, actual
  standing(p, k, n, checks)
  forget(n)
  return 2 + 3 * n
end

-- An operation's header (module doc) as {op, n, amount, keys, args (its
-- keys, and its arguments after the header), ...}; nil when malformed. Memoized
-- (lua/prelude.lua): the operations of a call mostly repeat their headers.
local op_of = memo(function(header)
  local op, n, amount, tail = string.match(header, '^(%l+) (%d+) (%d+)(.*)$')
  n, amount = tonumber(n), tonumber(amount)
  if op == nil or n == nil or amount == nil or n < 1 then
    return nil
  end
  if op == 'settle' then
    local expires, keep = string.match(tail, '^ (%d+) (%d+)$')
    if expires == nil or amount > MAX_ACTUAL then
      return nil
    end
    -- Formatted once a call: the record of a settle at `amount`.
    return {
      op = op, n = n, amount = amount, keys = n + 1, args = n + 2, as = int(amount),
      expires = tonumber(expires), keep = tonumber(keep),
    }
  end
  if tail ~= '' or not (op == 'reserve' or op == 'check') then
    return nil
  end
  return { op = op, n = n, amount = amount, keys = n, args = n }
end)

-- The call's operations, framed: per operation its header's table and
-- where its keys and arguments start, three entries each; nil when the
-- framing is wrong (a header, the number of keys or of fields). All are
-- read before any is made, so that such a call does nothing.
local function framed()
  local ops, nops, k, a, nkeys, nargs = {}, 0, 0, 2, #keys, #argv
  while a <= nargs do
    local o = op_of(argv[a])
    if o == nil or k + o.keys > nkeys or a + o.args > nargs then
      return nil
    end
    ops[nops + 1], ops[nops + 2], ops[nops + 3] = o, k, a
    nops = nops + 3
    k, a = k + o.keys, a + 1 + o.args
  end
  if k ~= nkeys or nops == 0 then
    return nil
  end
  return ops
end

-- A call of the budget function (the library's, or the script's where
-- Redis has none): its time, then its operations, one after another.
local function budget_call(call_keys, call_argv)
  keys, argv = call_keys, call_argv
  if argv[1] == '' then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + idiv(tonumber(t[2]), 1000)
  else
    now = count(argv[1])
  end
  local ops = now and framed()
  if ops == nil then
    return redis.error_reply('ERR malformed budget arguments')
  end
  out = {}
  state, save_with, taken, mark_of = {}, {}, {}, {}

  -- out[p - 1]: the length of the answer from out[p], known once written.
  local p = 2
  for i = 1, #ops, 3 do
    local o, ok, oa = ops[i], ops[i + 1], ops[i + 2]
    local length
    if o.op == 'settle' then
      length = settle(p, ok, oa, o)
    else
      length = reserve(p, ok, oa, o.n, o.amount, o.op == 'check')
    end
    out[p - 1] = length
    p = p + length + 1
  end
  -- Packed into one string, as batch.lua packs its answers.
  return cmsgpack.pack(out)
end
