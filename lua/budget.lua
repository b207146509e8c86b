-- ratekeeper's budget reservations (issue #23: reserve, then settle). Twin
-- of src/limiter/budget.rs and the markers of src/store/memory.rs; joined
-- after prelude.lua and the algorithm files, like batch.lua, as the second
-- function of the limiter's library (or a script of its own where Redis
-- has no functions): lua/README.md.
--
-- A call carries one or more operations, decided one after another, each
-- its own atomic step (as batch.lua decides requests), so that concurrent
-- Reserves and Settles share a call (src/store/batcher.rs). An operation's
-- keys are in one hash slot (on a cluster a call carries one operation).
-- ARGV[1] now in ms or "" for the server's TIME. Then per operation, in
-- order: in KEYS the reservation's marker in this slot, then the counter
-- keys of its checks in this slot, in order (n of them); in ARGV a header
-- "<op> <n> <amount>", with " k" after it when other slots hold some of
-- the reservation's counter keys and the next argument is all of them (of
-- every slot, one a line), then for reserve and check each check's
-- fields. A settle's " k" may be followed by " <keep>": once settled, its
-- marker lives keep ms at least (the first slot of several: a retry of a
-- settle cut short must find it; src/store/redis.rs). Every argument costs
-- Redis an object and Lua a string, so a reservation on one slot (any on
-- one Redis) sends no keys line.
--   reserve: amount = TTL in ms; the fields as batch.lua takes them
--            (hits = the estimate; charges are ignored).
--            -> {granted 1|0, then over, remaining, reset_ms per check}
--   check:   as reserve, but takes nothing and records nothing: the
--            outcomes of a refused reservation (for the slots a cluster
--            reservation did not reach once one slot refused).
--   settle:  amount = the actual cost. The marker is read with each key's
--            last reset (lua/reset.lua), in one MGET: a key reset since
--            the reservation gives nothing back (an excess is charged).
--            -> {0 unknown | 1 settled now | 2 settled before, the actual
--            it is settled at, then over, remaining, reset_ms per check,
--            the standing after the settlement}
-- The reply (packed by cmsgpack, as batch.lua's): per operation the length
-- of its answer, then the answer. An
-- operation whose fields (answer {-1, 1}) or marker ({-1, 2}) are
-- malformed does nothing; the others of the call stand.
-- The marker, a string expiring with the reservation, five fields
-- separated by tabs (counter keys escape control bytes, see src/keys.rs):
--   the state: '----------' while pending, else the actual it was
--   settled at, as ten digits (SETRANGE rewrites it in place);
--   the time of the reservation (ms), then the mark of each check (what
--   the algorithm's `reserve` returned; '-' when it took nothing),
--   separated by spaces;
--   this slot's checks' fields, one a line;
--   the header's line of the whole reservation's keys ('' on one slot);
--   this slot's counter keys, one a line.
-- A settle trusts only the marker, and only when it names exactly the keys
-- the settle does: another reservation's keys, or a part of them, touch
-- nothing. One string, written by one SET (NX: a reserve made again
-- finds it and takes nothing more) and read by one GET, costs Redis less
-- than a hash and its PEXPIRE; the marker is a large part of what a
-- reserve and a settle cost Redis (lua/README.md).

-- A count argument as a number; nil when it is not one.
local function count(arg)
  if arg ~= nil and string.match(arg, '^%d+$') then
    return tonumber(arg)
  end
  return nil
end

-- A marker's state while pending: as wide as a settled one (ten digits
-- hold any actual up to MAX_HITS, 2^32), so a settle rewrites it in place.
local PENDING, MAX_ACTUAL = '----------', 2 ^ 32

-- The call being made (set by budget_call, at the end): its keys and
-- arguments, its time, how every marker it writes begins (pending, made
-- now), and its answers. The helpers below read them as upvalues, so that
-- in the library they are made once, at FUNCTION LOAD, not on every call
-- (lua/README.md).
local keys, argv, now, pending_at, out
-- Per key of the operation being made, at the position of its first check
-- (`first`): its state, the check to save it with, and the reservation's
-- mark on it. Shared by the operations of a call and emptied after each
-- (made afresh by each call: a call cut short by an error leaves them as
-- they were). Indexed by position, not by key: each operation's keys are
-- new to a table keyed by them, and Lua rehashes such a table every few
-- keys.
local state, save_with, taken

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
    state[i], save_with[i], taken[i] = nil, nil, nil
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

-- A marker's fields (module doc).
local MARKER = '^([^\t]+)\t(%d+) ([^\t]*)\t([^\t]*)\t([^\t]*)\t(.*)$'

-- Answers a reserve of the checks keys[k + 1 .. k + n] (fields argv[a + 1
-- .. a + n]) whose marker keys[k], `v`, is already there: a call made
-- again after its connection broke before the reply (src/store/caller.rs)
-- repeats a reserve Redis had made. It takes nothing more, and answers as
-- the first did: granted, each check's standing from the state as stored,
-- which holds what the first took where its mark says it took (a check it
-- did not take from was over: a shadow limit). A marker that does not
-- parse, or marks another number of checks, is malformed ({-1, 2}). (The
-- in-memory twin is never asked twice: nothing lies between.) Its answer
-- goes to out from index p; returns the answer's length.
local function answer_made(p, k, a, n, v)
  local _, _, m = string.match(v, MARKER)
  local took = {}
  for mark in string.gmatch(m or '', '%S+') do
    took[#took + 1] = mark ~= '-'
  end
  if #took ~= n then
    return answer2(p, n, -1, 2)
  end
  local stored = {}
  out[p] = 1
  for i = 1, n do
    local c, key = check_of(argv[a + i]), keys[k + i]
    local s = stored[key] or c.algo.load(key, c, now)
    stored[key] = s
    local o, over = p + 3 * i - 2, not took[i] and c.hits > 0
    out[o] = over and 1 or 0
    out[o + 1], out[o + 2] = c.algo.report(s, c, over, took[i], now)
  end
  forget(n)
  return 1 + 3 * n
end

-- reserve (or check, when `only_check`) of the checks keys[k + 1 .. k + n]
-- with fields argv[a + 1 .. a + n], marker keys[k] (expiring after ttl ms,
-- px the same formatted as an argument); all_keys the whole reservation's
-- keys line ('' on one slot). Its answer goes to out from index p; returns the answer's
-- length.
local function reserve(p, k, a, n, px, ttl, all_keys, only_check)
  out[p] = 1
  local blocked, changed, marks = only_check, false, nil
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
    local mark = '-'
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
      taken[f], save_with[f], mark = m, c, int(m)
      changed = true
    end
    marks = marks and (marks .. ' ' .. mark) or mark
    local o = p + 3 * i - 2
    out[o] = over and 1 or 0
    out[o + 1], out[o + 2] = algo.report(s, c, over, applied, now)
  end
  if blocked then
    -- Unless its marker is there (a reserve made again, refused only by
    -- what it took the first time: answer_made), refused: nothing was
    -- saved; each check is reported against its state as stored, like a
    -- refused all-or-nothing request's (a lone check refused took
    -- nothing: its report stands).
    local v = not only_check and redis.call('GET', keys[k])
    if v then
      return answer_made(p, k, a, n, v)
    end
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
  local marker, sk, fields = keys[k], keys[k + 1], argv[a + 1]
  if n > 1 then
    sk, fields = table.concat(keys, '\n', k + 1, k + n), table.concat(argv, '\n', a + 1, a + n)
  end
  -- One command with its expiry. NX: a reserve made again finds its
  -- marker (the nonce is 128 random bits; answer_made).
  local made = redis.call('SET', marker,
    pending_at .. marks .. '\t' .. fields .. '\t' .. all_keys .. '\t' .. sk, 'NX', 'PX', px)
  if not made then
    return answer_made(p, k, a, n, redis.call('GET', marker))
  end
  for i = 1, n do
    local c = save_with[i]
    if c ~= nil then
      local s, algo = state[i], c.algo
      algo.save(keys[k + i], s, c, now, math.max(algo.ttl(s, c, now), 1))
    end
  end
  forget(n)
  return 1 + 3 * n
end

-- A number argument or marker field as a number: memoized, as the
-- settles of a call mostly settle reservations of one earlier call (the
-- same time, the same marks). (A closure, not memo(tonumber): the
-- library's top, run by FUNCTION LOAD, cannot reach `tonumber`.)
local number = memo(function(v)
  return tonumber(v)
end)

-- A lone check's checks and marks (read_marker's answer for one check).
local one_check, one_mark = {}, {}

-- The checks and marks a marker's c and m hold, n of each; nil when not.
local function read_marker(n, c, m)
  if n == 1 then
    local check = check_of(c)
    if check == nil or m == '' or string.find(m, ' ', 1, true) then
      return nil
    end
    one_check[1], one_mark[1] = check, number(m) or false
    return one_check, one_mark
  end
  local checks, marks = {}, {}
  for fields in string.gmatch(c, '[^\n]+') do
    checks[#checks + 1] = check_of(fields) or false
  end
  for mark in string.gmatch(m, '%S+') do
    marks[#marks + 1] = number(mark) or false
  end
  if #checks ~= n or #marks ~= n then
    return nil
  end
  for i = 1, n do
    if not checks[i] then
      return nil
    end
  end
  return checks, marks
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

-- The marker, then each key's last reset (lua/reset.lua), of an
-- operation on n checks whose keys follow its marker at keys[k]: one
-- command.
local function marker_and_resets(k, n)
  if n == 1 then
    return redis.call('MGET', keys[k], keys[k + 1] .. ':reset')
  end
  local names = { keys[k] }
  for i = 1, n do
    names[i + 1] = keys[k + i] .. ':reset'
  end
  return redis.call('MGET', unpack(names))
end

local function settle(p, k, n, actual, as, all_keys, keep)
  local got = marker_and_resets(k, n)
  local v = got[1]
  if not v then
    return answer2(p, n, 0, 0)
  end
  local settled, at, m, fields, all, sk = string.match(v, MARKER)
  if settled == nil then
    return answer2(p, n, -1, 2)
  end
  local expected = keys[k + 1]
  if n > 1 then
    expected = table.concat(keys, '\n', k + 1, k + n)
  end
  if sk ~= expected or all ~= all_keys then
    return answer2(p, n, 0, 0)
  end
  local checks, marks = read_marker(n, fields, m)
  at = number(at)
  if checks == nil then
    return answer2(p, n, -1, 2)
  end
  if settled ~= PENDING then
    local earlier = tonumber(settled)
    if earlier == nil then
      return answer2(p, n, -1, 2)
    end
    out[p], out[p + 1] = 2, earlier
    standing(p, k, n, checks)
    forget(n)
    return 2 + 3 * n
  end
  for i = 1, n do
    local c = checks[i]
    -- A key reset since the reservation lost what it took: nothing to
    -- give back (an excess is still charged).
    local reset = got[i + 1]
    local erased = reset and (tonumber(reset) or 0) >= at
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
  -- In place: the marker keeps its expiry, and only the state is sent.
  redis.call('SETRANGE', keys[k], '0', as)
  if keep ~= nil and redis.call('PTTL', keys[k]) < keep then
    redis.call('PEXPIRE', keys[k], int(keep))
  end
  out[p], out[p + 1] = 1, actual
  standing(p, k, n, checks)
  forget(n)
  return 2 + 3 * n
end

-- An operation's header, "<op> <n> <amount>", then " k" when the next
-- argument is the whole reservation's keys (and a settle's " <keep>"), as
-- {op, n, amount, args (the arguments after the header: that line and the
-- fields), ...}; nil when malformed. Memoized (lua/prelude.lua): the
-- operations of a call mostly repeat their headers.
local op_of = memo(function(header)
  local op, n, amount, tail = string.match(header, '^(%l+) (%d+) (%d+)(.*)$')
  n, amount = tonumber(n), tonumber(amount)
  local keep = tail and string.match(tail, '^ k (%d+)$')
  local line = tail == ' k' or keep ~= nil
  if op == nil or n == nil or amount == nil or n < 1 or not (line or tail == '')
    or not (op == 'settle' or op == 'reserve' or op == 'check')
    or (op == 'settle' and amount > MAX_ACTUAL) or (keep and op ~= 'settle') then
    return nil
  end
  local args = op == 'settle' and 0 or n
  if line then
    args = args + 1
  end
  -- Formatted once a call: a settle's state once settled at `amount`, a
  -- reserve's TTL as the marker's PX.
  local as = op == 'settle' and string.format('%010d', amount) or nil
  local px = op ~= 'settle' and int(math.max(amount, 1)) or nil
  return {
    op = op, n = n, amount = amount, as = as, px = px, line = line, args = args,
    keep = keep and tonumber(keep),
  }
end)

-- The call's operations, framed: per operation its header's table and
-- where its keys and arguments start, three entries each; nil when the
-- framing is wrong (a header, the number of keys or of fields). All are
-- read before any is made, so that such a call does nothing.
local function framed()
  local ops, nops, k, a, nkeys, nargs = {}, 0, 1, 2, #keys, #argv
  while a <= nargs do
    local o = op_of(argv[a])
    if o == nil or k + o.n > nkeys or a + o.args > nargs then
      return nil
    end
    ops[nops + 1], ops[nops + 2], ops[nops + 3] = o, k, a
    nops = nops + 3
    k, a = k + o.n + 1, a + 1 + o.args
  end
  if k ~= nkeys + 1 or nops == 0 then
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
  pending_at, out = PENDING .. '\t' .. int(now) .. ' ', {}
  state, save_with, taken = {}, {}, {}

  -- out[p - 1]: the length of the answer from out[p], known once written.
  local p = 2
  for i = 1, #ops, 3 do
    local o, ok, oa = ops[i], ops[i + 1], ops[i + 2]
    local all_keys = ''
    if o.line then
      oa = oa + 1
      all_keys = argv[oa]
    end
    local length
    if o.op == 'settle' then
      length = settle(p, ok, o.n, o.amount, o.as, all_keys, o.keep)
    else
      length = reserve(p, ok, oa, o.n, o.px, o.amount, all_keys, o.op == 'check')
    end
    out[p - 1] = length
    p = p + length + 1
  end
  -- Packed into one string, as batch.lua packs its answers.
  return cmsgpack.pack(out)
end
