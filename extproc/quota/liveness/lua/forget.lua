-- A dead processor's index, after a sweep: drop the open sets found empty and, once none
-- is left, the processor itself. Nothing at all while its heartbeat is there (it was only
-- slow, or it is back): what beat.lua listed is never dropped under a live processor.
--
-- KEYS[1]  the processor's heartbeat
-- KEYS[2]  the set of processor ids
-- KEYS[3]  the processor's index of open sets
-- ARGV     processor id, then the open-set keys found empty
-- Reply    -1: alive (nothing done); else how many open sets the index still lists
if redis.call('EXISTS', KEYS[1]) == 1 then
  return -1
end
for i = 2, #ARGV, 1000 do
  redis.call('SREM', KEYS[3], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
local left = redis.call('SCARD', KEYS[3])
if left == 0 then
  redis.call('DEL', KEYS[3])
  redis.call('SREM', KEYS[2], ARGV[1])
end
return left
