-- Admission: check and charge, all or none, every counter of one request.
--
-- KEYS[1]      reservation record (hash) of the request
-- KEYS[2..n+1] the current window of each counter (prefix:window_start): request counters
--              first, then token counters
-- KEYS[n+2]    the tenant's count of admitted, unsettled requests (incremented on admission)
-- ARGV         n_request, n_token, tokens, count_refused (1|0), record_ttl_s, owner,
--              soft (1|0), plan, model, client_request_id, prompt_tokens, then kind, limit,
--              window_s for each counter (its window start is the key's last part)
-- Constants    MARGIN (s a window key outlives its window), prepended by the backend
-- Reply        {replayed (0|1), verdict, now_s, now_us, cancelled (0|1), retry_soon (0|1),
--              wrong_window (0|1)}
--              verdict = "admitted,refused_by{,kind,limit,window_s,value,window_start}"
--
-- Every key touched is in KEYS. The caller computes each window start from its estimate of
-- this server's clock; windows still come from this server's TIME: when a passed start is
-- not the current one, nothing is charged and the reply says wrong_window=1 with TIME, and
-- the caller retries with the right keys. (The starts are read from the keys, not sent
-- twice: fewer arguments to pack per call.)
--
-- A record marked cancelled ('c', written by settle.lua in cancel mode) makes the admission
-- charge nothing at all: replayed=1 with the first verdict when the admission had run
-- before the cancel, replayed=0 and an empty verdict when it meets a tombstone.
--
-- An admitted record stores its owner ('o': the id of the processor that admitted it), so
-- a peer reconciling the open reservations of a processor that died settles only that
-- processor's records (settle.lua, orphan mode), and what the usage ledger needs from the
-- admission (plan, model, client request id, prompt tokens, TIME in µs; the tenant is the
-- key's hash tag).
--
-- Soft mode: refused by a token counter that the request could fit in (tokens <= limit)
-- while other requests of the tenant are open (KEYS[n+2] > 0), the admission charges and
-- records nothing and answers retry_soon=1: their unused leases come back when they settle.
local rkey = KEYS[1]
local t = redis.call('TIME')
local now_s = tonumber(t[1])

local prior = redis.call('HMGET', rkey, 'v', 'c')
if prior[2] then
  if prior[1] then
    return {1, prior[1], t[1], t[2], 1, 0, 0}
  end
  return {0, '', t[1], t[2], 1, 0, 0}
end
if prior[1] then
  return {1, prior[1], t[1], t[2], 0, 0, 0}
end

local n_req = tonumber(ARGV[1])
local n_tok = tonumber(ARGV[2])
local n = n_req + n_tok
local tokens = tonumber(ARGV[3])
local count_refused = ARGV[4] == '1'
local record_ttl = tonumber(ARGV[5])
local owner = ARGV[6]
local soft = ARGV[7] == '1'
local open_key = KEYS[n + 2]

local starts, values, windows = {}, {}, {}
for i = 1, n do
  local window = tonumber(ARGV[11 + i * 3])
  local start = now_s - (now_s % window)
  if tonumber(string.match(KEYS[i + 1], '(%d+)$')) ~= start then
    return {0, '', t[1], t[2], 0, 0, 1}
  end
  windows[i] = window
  starts[i] = start
end

local refused_by = ''
local refused_fits = false
for i = 1, n do
  local base = 8 + i * 3
  values[i] = tonumber(redis.call('GET', KEYS[i + 1]) or '0')
  local cost = tokens
  if i <= n_req then cost = 1 end
  if refused_by == '' and values[i] + cost > tonumber(ARGV[base + 2]) then
    refused_by = ARGV[base + 1]
    refused_fits = i > n_req and cost <= tonumber(ARGV[base + 2])
  end
end
local admitted = refused_by == ''
if soft and refused_fits and tonumber(redis.call('GET', open_key) or '0') > 0 then
  return {0, '', t[1], t[2], 0, 1, 0}
end

local function charge(i, amount)
  local v = redis.call('INCRBY', KEYS[i + 1], amount)
  if v == amount then
    -- New key (or one refunded to zero): expire shortly after its window ends.
    redis.call('PEXPIREAT', KEYS[i + 1], (starts[i] + windows[i] + MARGIN) * 1000)
  end
  values[i] = v
end

if admitted or count_refused then
  for i = 1, n_req do charge(i, 1) end
end

local record = {'v'}
local parts = {admitted and '1' or '0', refused_by}
if admitted then
  local reserved = 0
  if tokens > 0 and n_tok > 0 then
    reserved = tokens
    for i = n_req + 1, n do
      charge(i, tokens)
      record[#record + 1] = 'k' .. KEYS[i + 1]
      record[#record + 1] = tokens
    end
  end
  local more = {'res', reserved, 'pl', ARGV[8], 'md', ARGV[9], 'cr', ARGV[10],
    'pt', ARGV[11], 'at', t[1] .. string.format('%06d', tonumber(t[2]))}
  for _, x in ipairs(more) do record[#record + 1] = x end
  if owner ~= '' then
    record[#record + 1] = 'o'
    record[#record + 1] = owner
  end
  redis.call('INCR', open_key)
  redis.call('EXPIRE', open_key, record_ttl)
end
for i = 1, n do
  local base = 8 + i * 3
  parts[#parts + 1] = ARGV[base + 1]
  parts[#parts + 1] = ARGV[base + 2]
  parts[#parts + 1] = ARGV[base + 3]
  parts[#parts + 1] = string.format('%d', values[i])
  parts[#parts + 1] = string.format('%d', starts[i])
end
local verdict = table.concat(parts, ',')
table.insert(record, 2, verdict)
redis.call('HSET', rkey, unpack(record))
redis.call('EXPIRE', rkey, record_ttl)
return {0, verdict, t[1], t[2], 0, 0, 0}
