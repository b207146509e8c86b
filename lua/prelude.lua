-- ratekeeper's limiter script, part 1 of 3: helpers. src/store/limiter_script.rs
-- joins prelude.lua, the algorithm files and batch.lua into one script, or
-- into a function library whose one function is batch.lua.

-- Algorithm builders by key tag; each algorithm file adds its own. A script
-- runs from the top on every call, so building all five algorithms' closures
-- each time would cost more than most requests use: `algorithm(tag)` builds
-- the ones a request needs, once per call. (In the library the top runs once,
-- at FUNCTION LOAD, and an algorithm once built stays built.)
local B, A = {}, {}

local function algorithm(tag)
  local a = A[tag]
  if a == nil then
    a = B[tag]()
    A[tag] = a
  end
  return a
end

-- A memo of build(v): the checks of a call mostly repeat the same limits,
-- and its saves the same windows, counts and expiries, so most values a call
-- parses or formats it has met before. In the library a memo outlives calls
-- (the same limits come back call after call); it starts afresh once it
-- holds MEMO_MAX values, so that values seen once (clients choose their
-- hits) cannot grow it without bound. A nil from build is not kept.
local MEMO_MAX = 256
local function memo(build)
  local kept, count = {}, 0
  return function(v)
    local r = kept[v]
    if r == nil then
      r = build(v)
      if r ~= nil then
        if count == MEMO_MAX then
          kept, count = {}, 0
        end
        kept[v] = r
        count = count + 1
      end
    end
    return r
  end
end

-- floor(a / b) for non-negative integers below 2^53, exactly: double division
-- can round a quotient just below an integer up to it.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

local function ceil_div(a, b)
  return idiv(a + b - 1, b)
end

-- An integer as a command argument, formatted here: Redis would format a Lua
-- number with snprintf("%.17g"), which costs several times more than
-- string.format's integer path (exact below 2^63; ours stay below 2^53 but
-- for a bucket's budget marks on a key in long use: lua/gcra.lua).
local int = memo(function(n)
  return string.format('%d', n)
end)

-- A request's header, "<checks> <flags>" (lua/README.md): the flags are 1
-- all-or-nothing, plus 2 refused (another hash slot of the request refused
-- it) or 4 dry run (decided, nothing saved); as {n, all_or_nothing,
-- refused, dry}; nil when malformed.
local request_of = memo(function(header)
  local n, flags = string.match(header, '^(%d+) ([0-5])$')
  if n == nil then
    return nil
  end
  flags = tonumber(flags)
  return {
    n = tonumber(n), all_or_nothing = flags % 2 == 1, refused = flags == 2 or flags == 3,
    dry = flags >= 4,
  }
end)

-- A check's fields, "<tag> <limit> <period ms> <burst> <hits> <enforce 0|1>
-- <charges 0|1|2>" (lua/README.md), as the table the algorithms' steps take, with its
-- algorithm; nil when malformed or of no algorithm here. One argument per
-- check rather than six: Redis turns every argument into a string object
-- and a Lua string, which cost more than the check's own arithmetic. The
-- table is shared by every check with the same fields, so no step may
-- change it.
local check_of = memo(function(fields)
  local tag, limit, period, burst, hits, enforce, charges =
    string.match(fields, '^(%a+) (%d+) (%d+) (%d+) (%d+) ([01]) ([012])$')
  if tag == nil or B[tag] == nil then
    return nil
  end
  hits = tonumber(hits)
  return {
    tag = tag,
    algo = algorithm(tag),
    limit = tonumber(limit),
    period = tonumber(period),
    burst = tonumber(burst),
    hits = hits,
    need = math.max(hits, 1),
    enforce = enforce == '1',
    -- Hits over the limit are recorded (1 or 2); 2: a refused request
    -- records them only where the check is itself over (Charges::WhenOver).
    charges = charges ~= '0',
    when_over = charges == '2',
  }
end)

-- Whether check c records its hits on a request it found `over` (or, when
-- it fitted, that another check refused). Twin of Charges::records in
-- src/limiter/mod.rs.
local function charged(c, over)
  return c.charges and c.hits > 0 and (over or not c.when_over)
end

-- Whether check c records its hits on a refused request: all or nothing,
-- what `charged` says; otherwise what it admitted too, but for when_over,
-- which spares what it fitted whenever the request is refused. Twin of
-- Charges::records_refused in src/limiter/mod.rs.
local function refused_records(c, over, all_or_nothing)
  if all_or_nothing then
    return charged(c, over)
  end
  return c.hits > 0 and (c.charges or not over) and (over or not c.when_over)
end

-- The hits of check c a state holding `count` hits records: all of them, up
-- to a count of twice the limit (a debt of at most one limit). Admitted hits
-- always fit. Twin of `recordable` in src/limiter/mod.rs, which says why
-- (and why the fixed window has no such bound).
-- Comparisons rather than math.min/max: every admitted hit comes here, and
-- the two calls into C cost a one-key batch of fixed-window requests 6% more
-- of Redis's instructions (bench/lua_instructions.sh, shape `same`).
local function charge(c, count)
  local room = 2 * c.limit - count
  if c.hits <= room then
    return c.hits
  elseif room > 0 then
    return room
  end
  return 0
end
