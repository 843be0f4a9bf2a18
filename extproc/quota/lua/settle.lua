-- Settlement: commit used tokens and refund the rest of a reservation, exactly once.
--
-- KEYS[1]    reservation record (hash)
-- KEYS[2..]  token counter prefixes the request charged
-- KEYS[last] the tenant's count of admitted, unsettled requests (decremented here)
-- ARGV       used, margin_s, mode (0 settle | 1 cancel | 2 orphan), tombstone_ttl_s,
--            settled_ttl_s, owner, then window_s for each counter
-- Reply      {status, summary}: status 0 settled now, 1 already settled (first summary),
--            2 no admitted record (orphan mode only), 3 another owner's (orphan mode only)
--            summary = "reserved,used,refunded_1,...,refunded_n" (one per counter)
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
-- for the owner's own retries of settle to be answered from it, not the hour an open record
-- is kept for.
--
-- Per counter, the refund (reserved - used) is taken back from the newest window first:
-- the last batches are the unused ones. A window that has ended keeps its share of the
-- refund (it cannot be given back: that rate window is over). Use above the reservation is
-- charged to the current window. Without an admitted record nothing is charged.
local rkey = KEYS[1]
local t = redis.call('TIME')
local now_s = tonumber(t[1])
local used = tonumber(ARGV[1])
local margin = tonumber(ARGV[2])
local mode = ARGV[3]
local cancel = mode == '1'
local orphan = mode == '2'
local tombstone_ttl = tonumber(ARGV[4])
local settled_ttl = tonumber(ARGV[5])
local owner = ARGV[6]
local n = #KEYS - 2
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

local reserved = tonumber(rec['res'] or '0')
parts = {string.format('%d', reserved), string.format('%d', used)}
for i = 1, n do
  local prefix = KEYS[i + 1]
  local window = tonumber(ARGV[6 + i])
  local head = 'k' .. prefix .. ':'
  local charged = {}
  for field, amount in pairs(rec) do
    if string.sub(field, 1, #head) == head then
      local start = string.sub(field, #head + 1)
      if string.match(start, '^%d+$') then
        charged[#charged + 1] = {tonumber(start), tonumber(amount)}
      end
    end
  end
  table.sort(charged, function(a, b) return a[1] > b[1] end)

  local left = reserved - used
  local refunded = 0
  for _, w in ipairs(charged) do
    if left <= 0 then break end
    local take = math.min(left, w[2])
    left = left - take
    if w[1] + window > now_s then
      local key = prefix .. ':' .. string.format('%d', w[1])
      local current = tonumber(redis.call('GET', key) or '0')
      take = math.min(take, current)
      if take > 0 then
        redis.call('DECRBY', key, take)
        refunded = refunded + take
      end
    end
  end

  if used > reserved then
    local start = now_s - (now_s % window)
    local key = prefix .. ':' .. string.format('%d', start)
    local over = used - reserved
    local v = redis.call('INCRBY', key, over)
    if v == over then
      redis.call('PEXPIREAT', key, (start + window + margin) * 1000)
    end
  end
  parts[#parts + 1] = string.format('%d', refunded)
end

local summary = table.concat(parts, ',')
if redis.call('DECR', open_key) <= 0 then
  redis.call('DEL', open_key)  -- nobody open: no key (and no drift below zero)
end
if cancel then
  redis.call('HSET', rkey, 'st', summary, 'c', '1')
  return {0, summary}
end
if orphan then
  redis.call('HSET', rkey, 'st', summary, 'orphan', '1')
else
  redis.call('HSET', rkey, 'st', summary)
end
local ttl = redis.call('TTL', rkey)
if ttl < 0 or ttl > settled_ttl then
  redis.call('EXPIRE', rkey, settled_ttl)
end
return {0, summary}
