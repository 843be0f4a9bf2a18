-- Shared by admit, reserve and settle (prepended by the backend): one counter's window,
-- read, charge, refund. Per counter the caller passes its key and two bounds a, b:
--   fixed or calendar: KEYS holds prefix:a and the window is [a, b) (the caller computes
--     calendar bounds in the zone; this server's clock decides: outside them the script
--     charges nothing and answers "wrong window");
--   sliding (a = window_s W, b = bucket_s g): KEYS holds the counter's hash, one field per
--     bucket start, 'sum' (their total) and 'lo' (the oldest bucket that may be present).
--     A charge at t counts the buckets from cur - W to cur (cur: t's bucket), which cover
--     (t - W, t]: no interval of W seconds ever carries more than the limit. It is exact as
--     an upper bound and strict by up to one bucket (a charge up to g seconds old still
--     counts until its bucket leaves).
-- Fields of a reservation record name the window key or bucket a charge went to:
-- 'k' .. prefix .. ':' .. start, whatever the shape.

-- Numbers go to Redis as integers: Lua's own tostring turns 1e15 into '1e+15'.
local function int(x) return string.format('%d', x) end

local function server_time()
  local t = redis.call('TIME')
  if CLOCK_KEY ~= '' then
    -- Tests only (EXTPROC_TEST_CLOCK_KEY): seconds added to TIME, read from one key.
    local shift = redis.call('GET', CLOCK_KEY)
    if shift then t[1] = tostring(tonumber(t[1]) + tonumber(shift)) end
  end
  return t
end

-- nil when a fixed window's bounds are not this server's current ones.
local function open_counter(key, shape, a, b, now_s)
  if shape == 's' then
    local cur = now_s - now_s % b
    return {key = key, sliding = true, W = a, g = b, cur = cur, cutoff = cur - a,
            head = 'k' .. key .. ':', start = cur}
  end
  if now_s < a or now_s >= b then return nil end
  return {key = key, sliding = false, start = a, stop = b,
          head = 'k' .. string.sub(key, 1, #key - #tostring(a)), value = nil}
end

-- The counter's value now; a sliding one drops the buckets that left its window.
local function read(c)
  if not c.sliding then
    c.value = tonumber(redis.call('GET', c.key) or '0')
    return c.value
  end
  local h = redis.call('HMGET', c.key, 'lo', 'sum')
  local lo, sum = tonumber(h[1]), tonumber(h[2] or '0')
  if lo == nil then
    lo = c.cutoff
  elseif c.cutoff - lo > c.W then
    redis.call('DEL', c.key)  -- every bucket present is older than the window
    lo, sum = c.cutoff, 0
  elseif lo < c.cutoff then
    -- Walk the buckets that left, or the fields present when there are fewer of those
    -- (a counter idle for most of a long window): never more steps than either.
    if (c.cutoff - lo) / c.g > redis.call('HLEN', c.key) then
      local flat = redis.call('HGETALL', c.key)
      for i = 1, #flat, 2 do
        local start = tonumber(flat[i])
        if start and start < c.cutoff then
          sum = sum - tonumber(flat[i + 1])
          redis.call('HDEL', c.key, flat[i])
        end
      end
    else
      while lo < c.cutoff do
        local v = redis.call('HGET', c.key, int(lo))
        if v then
          sum = sum - tonumber(v)
          redis.call('HDEL', c.key, int(lo))
        end
        lo = lo + c.g
      end
    end
    lo = c.cutoff
    redis.call('HSET', c.key, 'lo', int(lo), 'sum', int(sum))
  end
  c.lo, c.value = lo, sum
  return sum
end

-- Add amount to the current window or bucket; returns the record field it went to.
local function charge(c, amount)
  if not c.sliding then
    local v = redis.call('INCRBY', c.key, int(amount))
    if v == amount then
      redis.call('PEXPIREAT', c.key, int((c.stop + MARGIN) * 1000))
    end
    c.value = v
    return 'k' .. c.key
  end
  redis.call('HINCRBY', c.key, int(c.cur), int(amount))
  c.value = c.value + amount
  redis.call('HSET', c.key, 'sum', int(c.value), 'lo', int(c.lo))
  redis.call('PEXPIREAT', c.key, int((c.cur + c.W + c.g + MARGIN) * 1000))
  return c.head .. int(c.cur)
end

-- Take back up to amount of what went to window or bucket `start`; returns what was
-- taken. An ended window (a bucket that left) keeps it.
local function refund(c, start, amount)
  if not c.sliding then
    if start ~= c.start then return 0 end
    local take = math.min(amount, c.value)
    if take > 0 then
      redis.call('DECRBY', c.key, int(take))
      c.value = c.value - take
    end
    return take
  end
  if start < c.cutoff then return 0 end
  local take = math.min(amount, tonumber(redis.call('HGET', c.key, int(start)) or '0'))
  if take > 0 then
    redis.call('HINCRBY', c.key, int(start), int(-take))
    c.value = c.value - take
    redis.call('HSET', c.key, 'sum', int(c.value))
  end
  return take
end

-- When the counter is back to zero (no further charge).
local function reset_at(c)
  if c.sliding then return c.cur + c.W + c.g end
  return c.stop
end

-- When `cost` would fit (asked on a refusal only); 0: at reset_at.
local function retry_at(c, cost, limit)
  if not c.sliding or cost > limit then return 0 end
  local flat = redis.call('HGETALL', c.key)
  local buckets = {}
  for i = 1, #flat, 2 do
    local start = tonumber(flat[i])
    if start then buckets[#buckets + 1] = {start, tonumber(flat[i + 1])} end
  end
  table.sort(buckets, function(x, y) return x[1] < y[1] end)
  local released = 0
  for _, b in ipairs(buckets) do
    released = released + b[2]
    if c.value - released + cost <= limit then return b[1] + c.W + c.g end
  end
  return 0
end

-- The record's charges on this counter, newest first: {start, amount, field}.
local function charged(c, rec)
  local out = {}
  local head = c.head
  for field, amount in pairs(rec) do
    if string.sub(field, 1, #head) == head then
      local start = string.sub(field, #head + 1)
      if string.match(start, '^%d+$') then
        out[#out + 1] = {tonumber(start), tonumber(amount), field}
      end
    end
  end
  table.sort(out, function(x, y) return x[1] > y[1] end)
  return out
end
