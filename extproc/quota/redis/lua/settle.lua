-- Settlement: commit used tokens and refund the rest of a reservation, exactly once, and
-- append its usage ledger entry in the same step.
--
-- KEYS[1]      reservation record (hash)
-- KEYS[2..n+1] each token counter's key (counters.lua), then (return mode) each request
--              counter's
-- KEYS[n+2]    the tenant's count of admitted, unsettled requests (decremented here)
-- KEYS[n+3]    the tenant's usage ledger (a Stream)
-- KEYS[n+4]    the tenant's set of records the owner (ARGV owner) holds open
-- ARGV         used, mode (0 settle | 1 cancel | 2 orphan | 3 return | 4 settle seen), tombstone_ttl_s,
--              owner, reason, output_tokens (-1: not given), cached_tokens, then shape
--              (f|s), a, b, input, output and cached input weights per counter, then
--              (return mode) n_request: the request counters, last of the n; (seen mode,
--              optional) 0, plan, model, client request id, prompt tokens: what the
--              admission recorded, for the ledger entry of one Redis lost
-- Constants    MARGIN, CLOCK_KEY, SETTLED_TTL (s), LEDGER (true|false), MAX_LEN (0: none),
--              RETENTION_MS (0: none): the backend's settings, and counters.lua and
--              ledger.lua, prepended by it (fewer arguments to pack per call)
-- Reply        {status, summary[, now_s, now_us]}: status 0 settled now, 1 already settled
--              (first summary), 2 no admitted record (orphan mode only), 3 another owner's
--              (orphan mode only), 4 wrong window (nothing done; TIME follows), 5 settled
--              now without a record (seen mode only)
--              summary = "reserved,used,refunded_1,...,refunded_n" (one per counter)
--
-- Per counter, what the request used is weighed like its charges (prompt less cached input
-- × input weight + cached × cached weight + output × output weight), and the difference
-- from what the record holds on that counter is refunded, newest window or bucket first,
-- or charged to the current one when it used more. Only the current window of a fixed or
-- calendar counter is live, so a refund touches that one key alone (the older windows the
-- record names are strings in the hash, never keys accessed); a sliding counter refunds
-- the buckets still inside its window. What has left its window keeps its share.
--
-- Cancel mode (used = 0) also marks the record cancelled ('c'), so a replayed or late
-- admission charges nothing; without any record it writes a tombstone (settled and
-- cancelled) that lives tombstone_ttl_s, for an admission still queued somewhere. A
-- cancelled record keeps its TTL for the same reason.
--
-- Seen mode settles a request whose admission the caller saw answered. Without any record
-- (not even a tombstone), Redis lost the admission after it was acknowledged (a failover,
-- a restart without persistence): its charges went with it, so what was used is charged
-- now, in the current windows, with a ledger entry (status 5). Plain settle mode charges
-- nothing there: a late replay of a settlement whose settled record expired would charge
-- twice.
--
-- Orphan mode settles the record of a processor that died (its heartbeat expired) with
-- used = what it had reserved: nothing is refunded, nothing more charged (call it with no
-- counter keys). Only a record admitted by that owner ('o' = ARGV owner) and still open is
-- touched; without a record nothing is written (the admission ran and its record expired).
--
-- Return mode gives an admission block back (base.py): cancel mode (used = 0, marked
-- cancelled, a tombstone without a record), and each request counter's live windows get
-- the slots the block holds for them ('q' .. window key) back; reason 'returned'. Orphan
-- mode on a block settles it like a request's record: what it holds stays charged.
--
-- A settled record (settle and orphan modes) then lives at most settled_ttl_s: long enough
-- for the owner's own retries of settle to be answered from it.
--
-- Every answer but wrong window takes the record's key out of the owner's open set
-- (admit.lua put it there): once settled, or found settled, or not the owner's, a peer has
-- nothing left to do with it. The settled flag ('st') makes the settlement itself exactly
-- once, whoever comes first: the owner, or a peer that took it for dead.
--
-- Ledger: one entry per record settled here (never on a replay, a refusal or a tombstone),
-- with 'windows' = per window the request was charged in, "kind:window_s:start:net", net
-- being what that window keeps of this request: summed over the ledger, a window's net is
-- the counter's value.
local rkey = KEYS[1]
local t = server_time()
local now_s = tonumber(t[1])
local used = tonumber(ARGV[1])
local mode = ARGV[2]
local cancel = mode == '1' or mode == '3'
local orphan = mode == '2'
local tombstone_ttl = tonumber(ARGV[3])
local owner = ARGV[4]
local n = #KEYS - 4
local n_req = tonumber(ARGV[8 + n * 6] or '0')
local n_tok = n - n_req
local open_key = KEYS[n + 2]
local owned_key = KEYS[n + 4]

local function done(reply)
  redis.call('SREM', owned_key, rkey)
  return reply
end

local flat = redis.call('HGETALL', rkey)
local rec = {}
for i = 1, #flat, 2 do rec[flat[i]] = flat[i + 1] end

if rec['st'] then
  return done({1, rec['st']})
end
if orphan then
  if not rec['v'] or string.sub(rec['v'], 1, 1) ~= '1' then
    return done({2, ''})
  end
  if rec['o'] ~= owner then
    return done({3, ''})
  end
  used = tonumber(rec['res'] or '0')
end
local parts = {}
local lost = mode == '4' and not rec['v']
if lost and ARGV[9 + n * 6] then
  local tags = 9 + n * 6
  rec['pl'], rec['md'], rec['cr'], rec['pt'] = ARGV[tags], ARGV[tags + 1], ARGV[tags + 2],
    ARGV[tags + 3]
end
if not lost and (not rec['v'] or string.sub(rec['v'], 1, 1) ~= '1') then
  parts = {'0', int(used)}
  for _ = 1, n_tok do parts[#parts + 1] = '0' end
  local summary = table.concat(parts, ',')
  if cancel then
    redis.call('HSET', rkey, 'st', summary, 'c', '1')
    if not rec['v'] then
      redis.call('EXPIRE', rkey, tombstone_ttl)
    end
  end
  return done({0, summary})
end

local cs = {}
for i = 1, n do
  local base = 8 + (i - 1) * 6
  cs[i] = open_counter(KEYS[i + 1], ARGV[base], tonumber(ARGV[base + 1]),
    tonumber(ARGV[base + 2]), now_s)
  if not cs[i] then
    return {4, '', t[1], t[2]}
  end
end

-- prompt + output = used: the caller's split, else admission's prompt count first.
local output = tonumber(ARGV[6])
if output < 0 then
  output = used - math.min(tonumber(rec['pt'] or '0'), used)
end
local prompt = used - output
local cached = math.min(tonumber(ARGV[7]), prompt)

local reserved = tonumber(rec['res'] or '0')
local net = {}  -- field of a charged window -> what it keeps of this request
parts = {int(reserved), int(used)}
for i = 1, n_tok do
  local c = cs[i]
  local base = 8 + (i - 1) * 6
  read(c)
  local used_c = (prompt - cached) * tonumber(ARGV[base + 3]) + output * tonumber(ARGV[base + 4])
    + cached * tonumber(ARGV[base + 5])
  local list = charged(c, rec)
  local held = 0
  for _, w in ipairs(list) do held = held + w[2] end
  local left = held - used_c
  local refunded = 0
  for _, w in ipairs(list) do
    if left <= 0 then break end
    local take = math.min(left, w[2])
    left = left - take
    local got = refund(c, w[1], take)
    if got > 0 then
      refunded = refunded + got
      net[w[3]] = w[2] - got
    end
  end
  if used_c > held then
    local over = used_c - held
    local field = charge(c, over)
    net[field] = (net[field] or tonumber(rec[field] or '0')) + over
    rec[field] = rec[field] or '0'
  end
  parts[#parts + 1] = int(refunded)
end
for i = n_tok + 1, n do  -- return mode: the block's unused request slots
  local c = cs[i]
  read(c)
  for _, w in ipairs(charged({head = 'q' .. string.sub(c.head, 2)}, rec)) do
    refund(c, w[1], w[2])
  end
end

local summary = table.concat(parts, ',')
if not lost and redis.call('DECR', open_key) <= 0 then  -- a lost admission's INCR went too
  redis.call('DEL', open_key)  -- nobody open: no key (and no drift below zero)
end
if cancel then
  redis.call('HSET', rkey, 'st', summary, 'c', '1')
elseif orphan then
  redis.call('HSET', rkey, 'st', summary, 'orphan', '1')
else
  redis.call('HSET', rkey, 'st', summary)
end
if not cancel or mode == '3' then  -- a returned block: no take of its key is to come
  local ttl = redis.call('TTL', rkey)
  if ttl < 0 or ttl > SETTLED_TTL then
    redis.call('EXPIRE', rkey, SETTLED_TTL)
  end
end

if LEDGER then
  local nets = {}
  for field, amount in pairs(rec) do
    if string.sub(field, 1, 1) == 'k' then  -- a charge: 'k' .. window key
      nets[#nets + 1] = {string.sub(field, 2), net[field] or tonumber(amount)}
    end
  end
  local reason = ARGV[5]  -- the backend's own in cancel and orphan modes
  local tenant, rid = reservation_names(rkey)
  local stream = KEYS[n + 3]
  local add = {'XADD', stream}
  if MAX_LEN > 0 then
    add[#add + 1] = 'MAXLEN'
    add[#add + 1] = '~'
    add[#add + 1] = MAX_LEN
  end
  local fields = {'*',
    'tenant', tenant, 'plan', rec['pl'] or '', 'model', rec['md'] or '',
    'request_id', rid, 'client_request_id', rec['cr'] or '',
    'prompt_tokens', prompt, 'output_tokens', output, 'reserved', reserved, 'used', used,
    'refunded', parts[3] or '0', 'windows', ledger_windows(nets, false), 'reason', reason,
    'admitted_at_us', rec['at'] or '', 'settled_at_us', t[1] .. string.format('%06d', tonumber(t[2]))}
  for _, x in ipairs(fields) do add[#add + 1] = x end
  local id = redis.call(unpack(add))
  if RETENTION_MS > 0 then
    -- Measured on the stream's own ids (the server's real clock), not on TIME.
    local id_ms = tonumber(string.match(id, '^(%d+)'))
    redis.call('XTRIM', stream, 'MINID', '~', string.format('%d', id_ms - RETENTION_MS))
  end
end
return done({lost and 5 or 0, summary})
