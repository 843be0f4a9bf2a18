-- Shared by settle and absorb (prepended by the backend, after counters.lua): what a usage
-- ledger entry reads back from key names, as the memory backend does. The constants come
-- from Python, rendered ahead of this file (redis_backend.load_lua): LEDGER_RANK and
-- LEDGER_UNRANKED (windows.LEDGER_WINDOW_RANK), WINDOW_KEY and RESERVATION_KEY
-- (keys.WINDOW_KEY_PATTERN, keys.RESERVATION_KEY_PATTERN: one text, a Python regex and a
-- Lua pattern alike).

-- keys.decode_name: a percent-encoded name back to its bytes.
local function decode_name(s)
  return (string.gsub(s or '', '%%(%x%x)', function(h) return string.char(tonumber(h, 16)) end))
end

-- keys.reservation_names: tenant and request id of a reservation key, decoded.
local function reservation_names(key)
  local tenant, rid = string.match(key, RESERVATION_KEY)
  return decode_name(tenant), decode_name(rid)
end

-- windows.ledger_windows: "kind:span:start:net" per {window key, net} of `nets`,
-- ';'-separated, by rank, then start, then text byte for byte (Lua's < on strings follows
-- the server's locale); other keys left out, and unranked kinds too when ranked_only.
local function ledger_windows(nets, ranked_only)
  local entries = {}
  for _, kn in ipairs(nets) do
    local kind, span, start = string.match(kn[1], WINDOW_KEY)
    if kind and (LEDGER_RANK[kind] or not ranked_only) then
      entries[#entries + 1] = {LEDGER_RANK[kind] or LEDGER_UNRANKED, tonumber(start),
        string.format('%s:%s:%s:%s', kind, span, start, int(kn[2]))}
    end
  end
  table.sort(entries, function(a, b)
    if a[1] ~= b[1] then return a[1] < b[1] end
    if a[2] ~= b[2] then return a[2] < b[2] end
    for i = 1, math.min(#a[3], #b[3]) do
      local x, y = string.byte(a[3], i), string.byte(b[3], i)
      if x ~= y then return x < y end
    end
    return #a[3] < #b[3]
  end)
  local out = {}
  for i, e in ipairs(entries) do out[i] = e[3] end
  return table.concat(out, ';')
end
