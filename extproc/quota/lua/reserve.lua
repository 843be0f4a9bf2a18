-- Lease batch: add tokens to an admitted, unsettled reservation, once per seq.
--
-- KEYS[1]      reservation record (hash)
-- KEYS[2..n+1] the current window of each token counter (prefix:window_start)
-- KEYS[n+2]    the tenant's count of admitted, unsettled requests
-- ARGV         seq, amount, minimum, then limit, window_s for each counter (its window
--              start is the key's last part)
-- Constants    MARGIN, prepended by the backend
-- Reply        {status, granted, now_s, now_us, value_1, window_start_1, ..., others_open}
--              status: granted | refused | replayed | not_admitted | settled | wrong_window
--              others_open: the tenant's other open requests (their unused leases come
--              back when they settle, so a refusal while they hold some may not be final)
--
-- wrong_window: a passed window start is not this server's current one (TIME decides);
-- nothing is charged and the caller retries with the right keys.
--
-- The grant is min(amount, smallest room left over the counters), or 0 when that is below
-- minimum: handing out what is left lets concurrent streams use up a budget instead of
-- each being refused a full batch near the end. A refusal charges and records nothing,
-- so the same seq may be tried again later.
local rkey = KEYS[1]
local t = redis.call('TIME')
local now_s = tonumber(t[1])

local verdict = redis.call('HGET', rkey, 'v')
if not verdict or string.sub(verdict, 1, 1) ~= '1' then
  return {'not_admitted', 0, t[1], t[2]}
end
if redis.call('HEXISTS', rkey, 'st') == 1 then
  return {'settled', 0, t[1], t[2]}
end

local seq_field = 'q' .. ARGV[1]
local amount = tonumber(ARGV[2])
local minimum = tonumber(ARGV[3])
local n = #KEYS - 2

local starts, values, windows = {}, {}, {}
for i = 1, n do
  local window = tonumber(ARGV[3 + 2 * i])
  local start = now_s - (now_s % window)
  if tonumber(string.match(KEYS[i + 1], '(%d+)$')) ~= start then
    return {'wrong_window', 0, t[1], t[2]}
  end
  windows[i] = window
  starts[i] = start
end
local granted = amount
for i = 1, n do
  local limit = tonumber(ARGV[2 + 2 * i])
  values[i] = tonumber(redis.call('GET', KEYS[i + 1]) or '0')
  if limit - values[i] < granted then granted = limit - values[i] end
end

local function reply(status, amount_out)
  local out = {status, amount_out, t[1], t[2]}
  for i = 1, n do
    out[#out + 1] = values[i]
    out[#out + 1] = starts[i]
  end
  local others = 0
  if status == 'refused' then
    others = math.max(0, tonumber(redis.call('GET', KEYS[n + 2]) or '0') - 1)
  end
  out[#out + 1] = others
  return out
end

local prior = redis.call('HGET', rkey, seq_field)
if prior then
  return reply('replayed', tonumber(prior))
end
if granted < minimum or granted <= 0 then
  return reply('refused', 0)
end

for i = 1, n do
  local key = KEYS[i + 1]
  local v = redis.call('INCRBY', key, granted)
  if v == granted then
    redis.call('PEXPIREAT', key, (starts[i] + windows[i] + MARGIN) * 1000)
  end
  values[i] = v
  redis.call('HINCRBY', rkey, 'k' .. key, granted)
end
redis.call('HINCRBY', rkey, 'res', granted)
redis.call('HSET', rkey, seq_field, granted)
return reply('granted', granted)
