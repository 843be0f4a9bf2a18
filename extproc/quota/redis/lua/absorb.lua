-- Charge tokens served while Redis was away into their windows, once per record key, and
-- append the usage ledger entry of what was charged, in the same step.
--
-- KEYS[1]      absorb record (hash) of one reservation (<reservation key>:absorb)
-- KEYS[2..m+1] one key per entry: the current window of the entry's counter
--              (prefix:window_start); several entries may name the same key
-- KEYS[m+2]    the tenant's usage ledger (a Stream)
-- ARGV         record_ttl_s, margin_s, ledger (1|0), max_len (0: none), retention_ms
--              (0: none), plan, model, client_request_id, reason, prompt_tokens,
--              output_tokens, admitted_at_us, then window_s, current_start, served_start,
--              amount for each entry
-- Constants    CLOCK_KEY, counters.lua and ledger.lua, prepended by the backend
-- Reply        {already (0|1), "live,moved"[, now_s, now_us]}: tokens charged to the window
--              they were served in, and tokens whose window had ended (or lies ahead of this
--              server's clock), charged to the current window instead; already = 2: a
--              passed current_start is not this server's (nothing done; TIME follows).
--
-- A fixed window's only live window is the current one, so every entry is charged to the
-- key in KEYS: served in it (live) or in an older or future one (moved). The ledger entry
-- (ledger=1: the reservation's token usage was served here) names those current windows.
local rkey = KEYS[1]
local done = redis.call('HGET', rkey, 'st')
if done then
  return {1, done}
end
local t = server_time()
local now_s = tonumber(t[1])
local margin = tonumber(ARGV[2])
local m = #KEYS - 2
for i = 2, m + 1 do
  local base = 13 + (i - 2) * 4
  local window = tonumber(ARGV[base])
  if tonumber(ARGV[base + 1]) ~= now_s - (now_s % window) then
    return {2, '', t[1], t[2]}
  end
end
local live, moved = 0, 0
local net, order = {}, {}
for i = 2, m + 1 do
  local base = 13 + (i - 2) * 4
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
  if not net[KEYS[i]] then order[#order + 1] = KEYS[i] end
  net[KEYS[i]] = (net[KEYS[i]] or 0) + amount
end
local summary = string.format('%d,%d', live, moved)
redis.call('HSET', rkey, 'st', summary)
redis.call('EXPIRE', rkey, tonumber(ARGV[1]))

if ARGV[3] == '1' then
  local nets = {}
  for _, key in ipairs(order) do nets[#nets + 1] = {key, net[key]} end
  local tenant, rid = reservation_names((string.gsub(rkey, ':absorb$', '')))
  local used = tonumber(ARGV[10]) + tonumber(ARGV[11])
  local stream = KEYS[m + 2]
  local add = {'XADD', stream}
  local max_len = tonumber(ARGV[4])
  if max_len > 0 then
    add[#add + 1] = 'MAXLEN'
    add[#add + 1] = '~'
    add[#add + 1] = max_len
  end
  local fields = {'*',
    'tenant', tenant, 'plan', ARGV[6], 'model', ARGV[7],
    'request_id', rid, 'client_request_id', ARGV[8],
    'prompt_tokens', ARGV[10], 'output_tokens', ARGV[11], 'reserved', used, 'used', used,
    'refunded', 0, 'windows', ledger_windows(nets, true), 'reason', ARGV[9],
    'admitted_at_us', ARGV[12], 'settled_at_us', t[1] .. string.format('%06d', tonumber(t[2]))}
  for _, x in ipairs(fields) do add[#add + 1] = x end
  local id = redis.call(unpack(add))
  local retention_ms = tonumber(ARGV[5])
  if retention_ms > 0 then
    -- Measured on the stream's own ids (the server's real clock), not on TIME.
    local id_ms = tonumber(string.match(id, '^(%d+)'))
    redis.call('XTRIM', stream, 'MINID', '~', string.format('%d', id_ms - retention_ms))
  end
end
return {0, summary}
