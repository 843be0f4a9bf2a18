-- A processor's heartbeat, and its index of the tenants' open sets, in one step (one slot:
-- every key here has the hash tag {~p}).
--
-- KEYS[1]  the processor's heartbeat (keys.heartbeat_key)
-- KEYS[2]  the set of processor ids (keys.processor_index_key)
-- KEYS[3]  the processor's index of open sets (keys.registries_key)
-- ARGV     processor id, heartbeat TTL (ms), index TTL (s), then open-set keys to list
--          (values, not keys touched: they live in the tenants' slots)
-- Reply    1 when the heartbeat was still there; 0: it had expired (or this is the first),
--          so peers may have taken the processor for dead
--
-- Heartbeat and index together: a sweeper drops index entries only while the heartbeat is
-- missing (forget.lua), so what this call lists stays listed while its heartbeat lives.
local existed = redis.call('EXISTS', KEYS[1])
redis.call('SET', KEYS[1], '1', 'PX', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
for i = 4, #ARGV, 1000 do
  redis.call('SADD', KEYS[3], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('EXPIRE', KEYS[3], ARGV[3])
return existed
