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

-- tonumber for call arguments, memoized: the checks of a call mostly repeat
-- the same limit, period, burst and hits, and Lua's tonumber parses a string
-- twice (lua_isnumber, then lua_tonumber), each time with strtod. In the
-- library the memo outlives calls (the same limits come back call after
-- call); it starts afresh once it holds PARSED_MAX strings, so that
-- arguments seen once (clients choose their hits) cannot grow it without
-- bound.
local PARSED_MAX = 256
local parsed, parsed_count = {}, 0
local function num(s)
  local v = parsed[s]
  if v == nil then
    v = tonumber(s)
    if v ~= nil then
      if parsed_count == PARSED_MAX then
        parsed, parsed_count = {}, 0
      end
      parsed[s] = v
      parsed_count = parsed_count + 1
    end
  end
  return v
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
-- string.format's integer path (exact below 2^63; ours stay below 2^53).
local function int(n)
  return string.format('%d', n)
end
