-- ratekeeper's limiter script, part 1 of 3: helpers. src/store/redis.rs joins
-- prelude.lua, the algorithm files and batch.lua into one script.

-- Algorithms by their key tag; each algorithm file adds itself.
local A = {}

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

-- An integer as argument text: Lua's own conversion switches to exponent
-- notation (and drops digits) above 1e14.
local function int(n)
  return string.format('%.0f', n)
end

local function copy(t)
  local c = {}
  for k, v in pairs(t) do
    c[k] = v
  end
  return c
end
