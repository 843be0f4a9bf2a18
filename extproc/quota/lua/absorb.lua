-- Charge tokens served while Redis was away into their windows, once per record key.
--
-- KEYS[1]    absorb record (hash) of one reservation
-- KEYS[2..]  one counter prefix per entry
-- ARGV       record_ttl_s, margin_s, then window_s, window_start, amount for each entry
-- Reply      {already (0|1), "live,moved"}: tokens charged to the window they were served
--            in, and tokens whose window had ended (or lies ahead of this server's clock),
--            charged to the current window instead.
local rkey = KEYS[1]
local done = redis.call('HGET', rkey, 'st')
if done then
  return {1, done}
end
local t = redis.call('TIME')
local now_s = tonumber(t[1])
local margin = tonumber(ARGV[2])
local live, moved = 0, 0
for i = 2, #KEYS do
  local base = 3 + (i - 2) * 3
  local window = tonumber(ARGV[base])
  local start = tonumber(ARGV[base + 1])
  local amount = tonumber(ARGV[base + 2])
  local current = now_s - (now_s % window)
  if start + window <= now_s or start > current then
    start = current
    moved = moved + amount
  else
    live = live + amount
  end
  local key = KEYS[i] .. ':' .. string.format('%d', start)
  local v = redis.call('INCRBY', key, amount)
  if v == amount then
    redis.call('PEXPIREAT', key, (start + window + margin) * 1000)
  end
end
local summary = string.format('%d,%d', live, moved)
redis.call('HSET', rkey, 'st', summary)
redis.call('EXPIRE', rkey, tonumber(ARGV[1]))
return {0, summary}
