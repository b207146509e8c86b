-- Fixed window for every limit of one request, all-or-nothing.
-- Redis twin of src/limiter/fixed_window.rs: keep the two in step.
--
-- KEYS[i]   counter of limit i: a hash {w = window index, c = count}
-- ARGV[1]   now in milliseconds, or "" to read the Redis server's clock
-- ARGV[2 + 4(i-1) ..]  limit, period_ms, hits, enforce ("1" or "0") of limit i
--
-- Returns {over, remaining, reset_ms} for each limit, flattened.
-- If any enforced limit would be exceeded nothing is written; otherwise every
-- limit with hits > 0 is incremented and its key given a TTL to the window's
-- end in the same step, so no counter ever lives without a TTL.

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(ARGV[1])
end

local n = #KEYS
-- Per key: the stored count and the running count including earlier limits
-- of this request (a request may repeat a descriptor).
local stored, running = {}, {}
local seen, over = {}, {}
local blocked = false
for i = 1, n do
  local a = 2 + (i - 1) * 4
  local key, limit, period, hits = KEYS[i], tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local window = math.floor(now / period)
  if running[key] == nil then
    local hash = redis.call('HMGET', key, 'w', 'c')
    if tonumber(hash[1]) == window then stored[key] = tonumber(hash[2]) else stored[key] = 0 end
    running[key] = stored[key]
  end
  local count = running[key]
  local need = hits
  if need < 1 then need = 1 end
  seen[i] = count
  over[i] = count + need > limit
  if over[i] and ARGV[a + 3] == '1' then blocked = true end
  running[key] = count + hits
end

local out = {}
for i = 1, n do
  local a = 2 + (i - 1) * 4
  local key, limit, period, hits = KEYS[i], tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local window = math.floor(now / period)
  local reset = (window + 1) * period - now
  local count
  if blocked then
    -- A refused request consumed nothing: report the stored count.
    count = stored[key]
  else
    count = seen[i] + hits
    if hits > 0 then
      redis.call('HSET', key, 'w', window, 'c', count)
      redis.call('PEXPIRE', key, reset)
    end
  end
  local remaining = limit - count
  if remaining < 0 then remaining = 0 end
  out[#out + 1] = over[i] and 1 or 0
  out[#out + 1] = remaining
  out[#out + 1] = reset
end
return out
