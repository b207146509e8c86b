-- The admin API's reset of counter keys (src/store/redis.rs `delete`):
-- KEYS the counters, all in one hash slot; ARGV[1] now in ms or '' for the
-- server's TIME. Each key is deleted; before that, a token or leaky
-- bucket with give-backs (`<key>:given`, lua/gcra.lua) counts what it had
-- queued as given back ahead of every reservation, so that reservations
-- made before the reset find their hits drained and give nothing back
-- (the TAT falls to now, and their marks must not land ahead of it).
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
return redis.call('DEL', unpack(KEYS))
