-- The admin API's reset of counter keys (src/store/redis.rs `delete`):
-- KEYS the counters, all in one hash slot; ARGV[1] now in ms or '' for the
-- server's TIME. Each key is deleted; before that, a token or leaky
-- bucket with give-backs (`<key>:given`, lua/gcra.lua) counts what it had
-- queued as given back ahead of every reservation, so that reservations
-- made before the reset find their hits drained and give nothing back
-- (the TAT falls to now, and their marks must not land ahead of it).
-- After it each key's reset is recorded (`<key>:reset`, its time in ms)
-- for as long as a reservation made before it may settle: such a settle
-- gives nothing back on the key (lua/budget.lua), as what the reservation
-- took went with the reset, and hits spent since are others'.
-- Twin: MemoryStore::delete (src/store/memory.rs).
local now = tonumber(ARGV[1])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
for i = 1, #KEYS do
  local given = KEYS[i] .. ':given'
  -- Only a bucket has give-backs, and a bucket's value is its TAT in µs.
  if redis.call('EXISTS', given) == 1 then
    local tat = tonumber(redis.call('GET', KEYS[i]))
    if tat ~= nil and tat > now * 1000 then
      redis.call('INCRBY', given, string.format('%d', tat - now * 1000))
    end
  end
end
local deleted = redis.call('DEL', unpack(KEYS))
-- The longest reservation TTL and a minute (twin of RESET_KEEP_MS in
-- src/limiter/budget.rs).
local keep = 3660000
for i = 1, #KEYS do
  redis.call('SET', KEYS[i] .. ':reset', string.format('%d', now), 'PX', keep)
end
return deleted
