-- Settlement: commit used tokens and refund the rest of a reservation, exactly once.
--
-- KEYS[1]    reservation record (hash)
-- KEYS[2..]  token counter prefixes the request charged
-- ARGV       used, margin_s, then window_s for each counter
-- Reply      {already_settled (0|1), summary}
--            summary = "reserved,used,refunded_1,...,refunded_n" (one per counter)
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
local n = #KEYS - 1

local flat = redis.call('HGETALL', rkey)
local rec = {}
for i = 1, #flat, 2 do rec[flat[i]] = flat[i + 1] end

if rec['st'] then
  return {1, rec['st']}
end
local parts = {}
if not rec['v'] or string.sub(rec['v'], 1, 1) ~= '1' then
  parts = {'0', string.format('%d', used)}
  for _ = 1, n do parts[#parts + 1] = '0' end
  return {0, table.concat(parts, ',')}
end

local reserved = tonumber(rec['res'] or '0')
parts = {string.format('%d', reserved), string.format('%d', used)}
for i = 1, n do
  local prefix = KEYS[i + 1]
  local window = tonumber(ARGV[2 + i])
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
redis.call('HSET', rkey, 'st', summary)
return {0, summary}
