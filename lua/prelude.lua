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
-- twice (lua_isnumber, then lua_tonumber), each time with strtod. Emptied by
-- batch.lua at the start of every call: in the library this table outlives
-- calls, and it must not grow with every distinct argument ever sent.
local parsed
local function num(s)
  local v = parsed[s]
  if v == nil then
    v = tonumber(s)
    parsed[s] = v
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
