-- Lease batch: add tokens to an admitted, unsettled reservation, once per seq.
--
-- KEYS[1]      reservation record (hash)
-- KEYS[2..n+1] each token counter's key (counters.lua)
-- KEYS[n+2]    the tenant's count of admitted, unsettled requests
-- KEYS[n+3]    the tenant's set of records this processor holds open (keys.open_set_key)
-- ARGV         seq, amount, minimum, then limit, shape (f|s), a, b, output weight,
--              shadow (1|0) per counter
-- Constants    MARGIN, CLOCK_KEY and counters.lua, prepended by the backend
-- Reply        {status, granted, now_s, now_us, value_1, reset_at_1, ..., others_open,
--              shadow counters that had less room than the grant (1-based, ;-separated)}
--              status: granted | refused | replayed | not_admitted | settled | wrong_window
--              others_open: the tenant's other open requests (their unused leases come
--              back when they settle, so a refusal while they hold some may not be final)
--
-- wrong_window: a passed window is not this server's current one (TIME decides); nothing
-- is charged and the caller retries with the right keys.
--
-- The grant is min(amount, the tokens the smallest room left over the counters pays for),
-- or 0 when that is below minimum: handing out what is left lets concurrent streams use up
-- a budget instead of each being refused a full batch near the end. A counter charges
-- grant × its output weight (a cost counter: the output price); one of weight 0 (input
-- tokens only) is not limited by a lease. A shadow counter limits nothing: it is charged
-- the grant, and named when it had less room. A refusal charges and records nothing, so
-- the same seq may be tried again later.
local rkey = KEYS[1]
local t = server_time()
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
local n = #KEYS - 3

local cs, weights, shadows, rooms = {}, {}, {}, {}
for i = 1, n do
  local base = 4 + (i - 1) * 6
  local c = open_counter(KEYS[i + 1], ARGV[base + 1], tonumber(ARGV[base + 2]),
    tonumber(ARGV[base + 3]), now_s)
  if not c then
    return {'wrong_window', 0, t[1], t[2]}
  end
  cs[i] = c
  weights[i] = tonumber(ARGV[base + 4])
  shadows[i] = ARGV[base + 5] == '1'
end
local granted = amount
for i = 1, n do
  local room = tonumber(ARGV[4 + (i - 1) * 6]) - read(cs[i])
  if weights[i] > 0 then
    rooms[i] = math.floor(math.max(room, 0) / weights[i])
    if not shadows[i] and rooms[i] < granted then granted = rooms[i] end
  end
end

local function reply(status, amount_out, would)
  local out = {status, amount_out, t[1], t[2]}
  for i = 1, n do
    out[#out + 1] = int(cs[i].value)
    out[#out + 1] = int(reset_at(cs[i]))
  end
  local others = 0
  if status == 'refused' then
    others = math.max(0, tonumber(redis.call('GET', KEYS[n + 2]) or '0') - 1)
  end
  out[#out + 1] = others
  out[#out + 1] = would or ''
  return out
end

local prior = redis.call('HGET', rkey, seq_field)
if prior then
  return reply('replayed', tonumber(prior))
end
if granted < minimum or granted <= 0 then
  return reply('refused', 0)
end

local would = {}
for i = 1, n do
  if weights[i] > 0 then
    if shadows[i] and rooms[i] < granted then would[#would + 1] = i end
    local field = charge(cs[i], granted * weights[i])
    redis.call('HINCRBY', rkey, field, int(granted * weights[i]))
  end
end
redis.call('HINCRBY', rkey, 'res', granted)
redis.call('HSET', rkey, seq_field, granted)
-- A stream that outlives its record's lifetime is still open: each grant renews it, or the
-- record would expire mid-stream and its settlement charge the stream a second time; and
-- the keys that list it open, or a peer could not find it once its owner died.
local lifetime = tonumber(redis.call('HGET', rkey, 'tl') or '0')
if lifetime > 0 then
  redis.call('EXPIRE', rkey, lifetime)
  for _, listing in ipairs({KEYS[n + 2], KEYS[n + 3]}) do
    if redis.call('TTL', listing) < lifetime then redis.call('EXPIRE', listing, lifetime) end
  end
end
return reply('granted', granted, table.concat(would, ';'))
