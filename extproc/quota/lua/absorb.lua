-- Charge tokens served while Redis was away into their windows, once per record key.
--
-- KEYS[1]    absorb record (hash) of one reservation
-- KEYS[2..]  one key per entry: the current window of the entry's counter
--            (prefix:window_start); several entries may name the same key
-- ARGV       record_ttl_s, margin_s, then window_s, current_start, served_start, amount
--            for each entry
-- Reply      {already (0|1), "live,moved"[, now_s, now_us]}: tokens charged to the window
--            they were served in, and tokens whose window had ended (or lies ahead of this
--            server's clock), charged to the current window instead; already = 2: a
--            passed current_start is not this server's (nothing done; TIME follows).
--
-- A fixed window's only live window is the current one, so every entry is charged to the
-- key in KEYS: served in it (live) or in an older or future one (moved).
local rkey = KEYS[1]
local done = redis.call('HGET', rkey, 'st')
if done then
  return {1, done}
end
local t = redis.call('TIME')
local now_s = tonumber(t[1])
local margin = tonumber(ARGV[2])
for i = 2, #KEYS do
  local base = 3 + (i - 2) * 4
  local window = tonumber(ARGV[base])
  if tonumber(ARGV[base + 1]) ~= now_s - (now_s % window) then
    return {2, '', t[1], t[2]}
  end
end
local live, moved = 0, 0
for i = 2, #KEYS do
  local base = 3 + (i - 2) * 4
  local window = tonumber(ARGV[base])
  local current = tonumber(ARGV[base + 1])
  local amount = tonumber(ARGV[base + 3])
  if tonumber(ARGV[base + 2]) == current then
    live = live + amount
  else
    moved = moved + amount
  end
  local v = redis.call('INCRBY', KEYS[i], amount)
  if v == amount then
    redis.call('PEXPIREAT', KEYS[i], (current + window + margin) * 1000)
  end
end
local summary = string.format('%d,%d', live, moved)
redis.call('HSET', rkey, 'st', summary)
redis.call('EXPIRE', rkey, tonumber(ARGV[1]))
return {0, summary}
