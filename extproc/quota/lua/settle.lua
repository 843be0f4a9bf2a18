-- Settlement: commit used tokens and refund the rest of a reservation, exactly once, and
-- append its usage ledger entry in the same step.
--
-- KEYS[1]      reservation record (hash)
-- KEYS[2..n+1] the current window (prefix:window_start) of each token counter charged
-- KEYS[n+2]    the tenant's count of admitted, unsettled requests (decremented here)
-- KEYS[n+3]    the tenant's usage ledger (a Stream)
-- ARGV         used, mode (0 settle | 1 cancel | 2 orphan), tombstone_ttl_s, owner,
--              reason, output_tokens (-1: not given), then window_s for each counter (its
--              window start is the key's last part)
-- Constants    MARGIN, SETTLED_TTL (s), LEDGER (true|false), MAX_LEN (0: none),
--              RETENTION_MS (0: none): the backend's settings, prepended by it (fewer
--              arguments to pack per call)
-- Reply        {status, summary[, now_s, now_us]}: status 0 settled now, 1 already settled
--              (first summary), 2 no admitted record (orphan mode only), 3 another owner's
--              (orphan mode only), 4 wrong window (nothing done; TIME follows)
--              summary = "reserved,used,refunded_1,...,refunded_n" (one per counter)
--
-- Only the current window of a counter is live (fixed windows), so a refund and any use
-- above the reservation touch that one key alone; the older windows the record names are
-- strings in the hash, never keys accessed. A window that has ended keeps its share of the
-- refund (that rate window is over).
--
-- Cancel mode (used = 0) also marks the record cancelled ('c'), so a replayed or late
-- admission charges nothing; without any record it writes a tombstone (settled and
-- cancelled) that lives tombstone_ttl_s, for an admission still queued somewhere. A
-- cancelled record keeps its TTL for the same reason.
--
-- Orphan mode settles the record of a processor that died (its heartbeat expired) with
-- used = what it had reserved: nothing is refunded, nothing more charged (call it with no
-- counter keys). Only a record admitted by that owner ('o' = ARGV owner) and still open is
-- touched; without a record nothing is written (the admission ran and its record expired).
--
-- A settled record (settle and orphan modes) then lives at most settled_ttl_s: long enough
-- for the owner's own retries of settle to be answered from it.
--
-- Ledger: one entry per record settled here (never on a replay, a refusal or a tombstone),
-- with 'windows' = per window the request was charged in, "kind:window_s:start:net", net
-- being what that window keeps of this request: summed over the ledger, a window's net is
-- the counter's value.
local rkey = KEYS[1]
local t = redis.call('TIME')
local now_s = tonumber(t[1])
local used = tonumber(ARGV[1])
local mode = ARGV[2]
local cancel = mode == '1'
local orphan = mode == '2'
local tombstone_ttl = tonumber(ARGV[3])
local owner = ARGV[4]
local n = #KEYS - 3
local open_key = KEYS[n + 2]

local flat = redis.call('HGETALL', rkey)
local rec = {}
for i = 1, #flat, 2 do rec[flat[i]] = flat[i + 1] end

if rec['st'] then
  return {1, rec['st']}
end
if orphan then
  if not rec['v'] or string.sub(rec['v'], 1, 1) ~= '1' then
    return {2, ''}
  end
  if rec['o'] ~= owner then
    return {3, ''}
  end
  used = tonumber(rec['res'] or '0')
end
local parts = {}
if not rec['v'] or string.sub(rec['v'], 1, 1) ~= '1' then
  parts = {'0', string.format('%d', used)}
  for _ = 1, n do parts[#parts + 1] = '0' end
  local summary = table.concat(parts, ',')
  if cancel then
    redis.call('HSET', rkey, 'st', summary, 'c', '1')
    if not rec['v'] then
      redis.call('EXPIRE', rkey, tombstone_ttl)
    end
  end
  return {0, summary}
end

local starts = {}
for i = 1, n do
  local window = tonumber(ARGV[6 + i])
  local start = now_s - (now_s % window)
  if tonumber(string.match(KEYS[i + 1], '(%d+)$')) ~= start then
    return {4, '', t[1], t[2]}
  end
  starts[i] = start
end

local reserved = tonumber(rec['res'] or '0')
local net = {}  -- field of a charged window -> what it keeps of this request
parts = {string.format('%d', reserved), string.format('%d', used)}
for i = 1, n do
  local key = KEYS[i + 1]
  local current_field = 'k' .. key
  local head = string.sub(current_field, 1, #current_field - #tostring(starts[i]))
  local charged = {}
  for field, amount in pairs(rec) do
    if string.sub(field, 1, #head) == head and string.match(string.sub(field, #head + 1), '^%d+$') then
      charged[#charged + 1] = {tonumber(string.sub(field, #head + 1)), tonumber(amount), field}
    end
  end
  table.sort(charged, function(a, b) return a[1] > b[1] end)

  local left = reserved - used
  local refunded = 0
  for _, w in ipairs(charged) do
    if left <= 0 then break end
    local take = math.min(left, w[2])
    left = left - take
    if w[1] == starts[i] then
      take = math.min(take, tonumber(redis.call('GET', key) or '0'))
      if take > 0 then
        redis.call('DECRBY', key, take)
        refunded = refunded + take
        net[w[3]] = w[2] - take
      end
    end
  end

  if used > reserved then
    local over = used - reserved
    local v = redis.call('INCRBY', key, over)
    if v == over then
      redis.call('PEXPIREAT', key, (starts[i] + tonumber(ARGV[6 + i]) + MARGIN) * 1000)
    end
    net[current_field] = (net[current_field] or tonumber(rec[current_field] or '0')) + over
    rec[current_field] = rec[current_field] or '0'
  end
  parts[#parts + 1] = string.format('%d', refunded)
end

local summary = table.concat(parts, ',')
if redis.call('DECR', open_key) <= 0 then
  redis.call('DEL', open_key)  -- nobody open: no key (and no drift below zero)
end
if cancel then
  redis.call('HSET', rkey, 'st', summary, 'c', '1')
elseif orphan then
  redis.call('HSET', rkey, 'st', summary, 'orphan', '1')
else
  redis.call('HSET', rkey, 'st', summary)
end
if not cancel then
  local ttl = redis.call('TTL', rkey)
  if ttl < 0 or ttl > SETTLED_TTL then
    redis.call('EXPIRE', rkey, SETTLED_TTL)
  end
end

if LEDGER then
  local rank = {tpm = 1, tenant_tpm = 2, daily = 3}
  local entries = {}
  for field, amount in pairs(rec) do
    local kind, window, start = string.match(field, '^k.*:c:([%w_]+):[^:]*:(%d+):(%d+)$')
    if kind then
      entries[#entries + 1] = {rank[kind] or 9, tonumber(start), string.format(
        '%s:%s:%s:%d', kind, window, start, net[field] or tonumber(amount))}
    end
  end
  table.sort(entries, function(a, b)
    if a[1] ~= b[1] then return a[1] < b[1] end
    return a[2] < b[2]
  end)
  local windows = {}
  for i, e in ipairs(entries) do windows[i] = e[3] end
  -- prompt + output = used: the caller's split, else admission's prompt count first.
  local output = tonumber(ARGV[6])
  if output < 0 then
    output = used - math.min(tonumber(rec['pt'] or '0'), used)
  end
  local prompt = used - output
  local reason = ARGV[5]
  if cancel then reason = 'cancelled' elseif orphan then reason = 'orphaned' end
  local function decode(s)
    return (string.gsub(s or '', '%%(%x%x)', function(h) return string.char(tonumber(h, 16)) end))
  end
  local rid = decode(string.match(rkey, ':r:(.*)$'))
  local tenant = decode(string.match(rkey, '{([^}]*)}'))
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
    'refunded', parts[3] or '0', 'windows', table.concat(windows, ';'), 'reason', reason,
    'admitted_at_us', rec['at'] or '', 'settled_at_us', t[1] .. string.format('%06d', tonumber(t[2]))}
  for _, x in ipairs(fields) do add[#add + 1] = x end
  redis.call(unpack(add))
  if RETENTION_MS > 0 then
    local now_ms = now_s * 1000 + math.floor(tonumber(t[2]) / 1000)
    redis.call('XTRIM', stream, 'MINID', '~', string.format('%d', now_ms - RETENTION_MS))
  end
end
return {0, summary}
