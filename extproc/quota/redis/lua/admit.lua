-- Admission: check and charge, all or none, every counter of one request.
--
-- KEYS[1]      reservation record (hash) of the request
-- KEYS[2..n+1] each counter's key (counters.lua): request counters first, then token
--              counters
-- KEYS[n+2]    the tenant's count of admitted, unsettled requests (incremented on admission)
-- KEYS[n+3]    the tenant's set of records the owner (ARGV[6]) holds open (keys.open_set_key)
-- KEYS[n+4]    mode 'from' only: the admission block (a record) to take the request from
-- ARGV         n_request, n_token, tokens, count_refused (1|0), record_ttl_s, owner,
--              soft (1|0), plan, model, client_request_id, prompt_tokens, then kind, limit,
--              shape (f|s), a, b, input weight, output weight, shadow (1|0) per counter,
--              then mode ('' admit | 'take' a block | 'from' a block), block requests (take)
-- Constants    MARGIN (s a window key outlives its window), CLOCK_KEY, and counters.lua,
--              prepended by the backend
-- Reply        {replayed (0|1), verdict, now_s, now_us, cancelled (0|1), retry_soon (0|1),
--              wrong_window (0|1)[, from_block (0|1): mode 'from', once admitted]}
--              verdict = "admitted,refused_by,shadow kinds (;-separated)
--                         {,kind,limit,value,reset_at,retry_at}" (retry_at 0: reset_at)
--
-- A request counter charges 1. A token counter charges prompt × input weight + the rest of
-- `tokens` (the output reserved) × output weight: a cost counter's weights are prices.
--
-- Every key touched is in KEYS. The caller computes each window from its estimate of this
-- server's clock; windows still come from this server's TIME: when a passed window is not
-- the current one, nothing is charged and the reply says wrong_window=1 with TIME, and the
-- caller retries with the right keys.
--
-- A shadow counter is charged like the others but refuses nothing: the kinds that would
-- have refused are in the verdict.
--
-- A record marked cancelled ('c', written by settle.lua in cancel mode) makes the admission
-- charge nothing at all: replayed=1 with the first verdict when the admission had run
-- before the cancel, replayed=0 and an empty verdict when it meets a tombstone.
--
-- An admitted record stores its owner ('o': the id of the processor that admitted it), so
-- a peer reconciling the open reservations of a processor that died settles only that
-- processor's records (settle.lua, orphan mode), and what the usage ledger needs from the
-- admission (plan, model, client request id, prompt tokens, TIME in µs; the tenant is the
-- key's hash tag). The record's key joins the owner's open set in the tenant's slot in the
-- same step: a charge is never made that a peer cannot find once its owner is dead. The set
-- lives as long as the newest record it lists; settle.lua takes the key out.
--
-- Soft mode: refused by a token counter that the request could fit in (tokens <= limit)
-- while other requests of the tenant are open (KEYS[n+2] > 0), the admission charges and
-- records nothing and answers retry_soon=1: their unused leases come back when they settle.
--
-- Take mode (an admission block, base.py): the record at KEYS[1] is the block. A request
-- counter charges the block's requests, a token counter tokens × max(input, output
-- weight); the caller passes count_refused = soft = 0 and shadow = 0 (a block is never
-- taken past a shadow limit). The record also holds 'rq' (request slots left) and per
-- request counter 'q' .. window key -> slots it can give back.
--
-- From mode: when the record of KEYS[1] is new and the block (KEYS[n+4]) is admitted,
-- unsettled, the owner's, with a slot left and at least the request's cost in its field of
-- every token counter, the slot and costs move from the block to KEYS[1]'s new record
-- (the block's windows: whether they are still current does not matter), counters
-- untouched; the verdict holds the counters' current states. Otherwise: an admission.
local rkey = KEYS[1]
local t = server_time()
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
local prompt = math.min(tonumber(ARGV[11]), tokens)
local open_key = KEYS[n + 2]
local owned_key = KEYS[n + 3]
local mode = ARGV[12 + n * 8] or ''
local take = mode == 'take'
local slots = take and tonumber(ARGV[13 + n * 8]) or 0

local cs, costs, limits, kinds, shadows = {}, {}, {}, {}, {}
for i = 1, n do
  local base = 4 + i * 8
  local c = open_counter(KEYS[i + 1], ARGV[base + 2], tonumber(ARGV[base + 3]),
    tonumber(ARGV[base + 4]), now_s)
  if not c then
    return {0, '', t[1], t[2], 0, 0, 1}
  end
  cs[i] = c
  kinds[i] = ARGV[base]
  limits[i] = tonumber(ARGV[base + 1])
  shadows[i] = ARGV[base + 7] == '1'
  if take then
    if i <= n_req then
      costs[i] = slots
    else
      costs[i] = tokens * math.max(tonumber(ARGV[base + 5]), tonumber(ARGV[base + 6]))
    end
  elseif i <= n_req then
    costs[i] = 1
  else
    costs[i] = prompt * tonumber(ARGV[base + 5]) + (tokens - prompt) * tonumber(ARGV[base + 6])
  end
end

-- From mode: the block's fields each cost moves from ({field, cost}), nil when it cannot.
local function block_share(block)
  if not block['v'] or string.sub(block['v'], 1, 1) ~= '1' or block['st'] then return nil end
  if block['o'] ~= owner or tonumber(block['rq'] or '0') < 1 then return nil end
  local moves = {}
  for i = n_req + 1, n do
    if costs[i] > 0 then
      local w = charged(cs[i], block)[1]
      if not w or w[2] < costs[i] then return nil end
      moves[#moves + 1] = {w[3], costs[i]}
    end
  end
  return moves
end

local bkey, block, moves = KEYS[n + 4], nil, nil
if mode == 'from' then
  local flat = redis.call('HGETALL', bkey)
  block = {}
  for i = 1, #flat, 2 do block[flat[i]] = flat[i + 1] end
  moves = block_share(block)
end

local refused_by, refused_at = '', 0
local refused_fits = false
local would = {}
for i = 1, n do
  if read(cs[i]) + costs[i] > limits[i] and not moves then
    if shadows[i] then
      would[#would + 1] = kinds[i]
    elseif refused_by == '' then
      refused_by, refused_at = kinds[i], i
      refused_fits = i > n_req and costs[i] <= limits[i]
    end
  end
end
local admitted = refused_by == ''
if soft and refused_fits and tonumber(redis.call('GET', open_key) or '0') > 0 then
  return {0, '', t[1], t[2], 0, 1, 0}
end
if not admitted then would = {} end

local record = {'v'}
if moves then
  -- The slot: 'rq' and the first 'q' field of each request counter give one back.
  redis.call('HINCRBY', bkey, 'rq', -1)
  for i = 1, n_req do
    local q = charged({head = 'q' .. string.sub(cs[i].head, 2)}, block)[1]
    if q and q[2] > 0 then redis.call('HINCRBY', bkey, q[3], -1) end
  end
  for _, m in ipairs(moves) do
    redis.call('HINCRBY', bkey, m[1], int(-m[2]))
    record[#record + 1] = m[1]
    record[#record + 1] = int(m[2])
  end
  redis.call('HSET', bkey, 'res', int(math.max(0, tonumber(block['res'] or '0') - tokens)))
elseif admitted or count_refused then
  for i = 1, n_req do
    local field = charge(cs[i], costs[i])
    if take and admitted then
      record[#record + 1] = 'q' .. string.sub(field, 2)
      record[#record + 1] = int(costs[i])
    end
  end
end

local parts = {admitted and '1' or '0', refused_by, table.concat(would, ';')}
if admitted then
  local reserved = 0
  if take then
    record[#record + 1] = 'rq'
    record[#record + 1] = int(slots)
  end
  if moves then
    reserved = tokens
  elseif tokens > 0 and n_tok > 0 then
    reserved = tokens
    for i = n_req + 1, n do
      if costs[i] > 0 then
        record[#record + 1] = charge(cs[i], costs[i])
        record[#record + 1] = int(costs[i])
      end
    end
  end
  -- 'tl': the open record's lifetime, renewed by each granted lease (reserve.lua)
  local more = {'res', reserved, 'pl', ARGV[8], 'md', ARGV[9], 'cr', ARGV[10],
    'pt', ARGV[11], 'at', t[1] .. string.format('%06d', tonumber(t[2])), 'tl', record_ttl}
  for _, x in ipairs(more) do record[#record + 1] = x end
  if owner ~= '' then
    record[#record + 1] = 'o'
    record[#record + 1] = owner
    redis.call('SADD', owned_key, rkey)
    if redis.call('TTL', owned_key) < record_ttl then
      redis.call('EXPIRE', owned_key, record_ttl)
    end
  end
  redis.call('INCR', open_key)
  redis.call('EXPIRE', open_key, record_ttl)
end
for i = 1, n do
  parts[#parts + 1] = kinds[i]
  parts[#parts + 1] = ARGV[4 + i * 8 + 1]
  parts[#parts + 1] = int(cs[i].value)
  parts[#parts + 1] = int(reset_at(cs[i]))
  parts[#parts + 1] = int(i == refused_at and retry_at(cs[i], costs[i], limits[i]) or 0)
end
local verdict = table.concat(parts, ',')
table.insert(record, 2, verdict)
redis.call('HSET', rkey, unpack(record))
redis.call('EXPIRE', rkey, record_ttl)
if mode == 'from' then return {0, verdict, t[1], t[2], 0, 0, 0, moves and 1 or 0} end
return {0, verdict, t[1], t[2], 0, 0, 0}
