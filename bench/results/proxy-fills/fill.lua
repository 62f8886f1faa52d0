-- Every request a new cacheable URL: a miss the proxy stores.
local n = 0
math.randomseed(os.time() + os.clock() * 1e6)
request = function()
  n = n + 1
  return wrk.format("GET", "/fill/" .. math.random(1, 1000000000) .. "-" .. n)
end
