package main

import (
	"math"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
	"github.com/labstack/echo/v4"
	"golang.org/x/time/rate"
)

// The edge: what one client may hold and how fast it may ask. The server-wide
// limits are set in listenHTTP; what is per request or per client lives here.

// maxHeaderBytes bounds the request line and headers; the default 1 MB is far
// more than any client of this service sends.
const maxHeaderBytes = 64 << 10

// maxRateLimitedIPs bounds the limiter's memory: past it the least recently
// seen client IP loses its bucket (and starts with a full one if it returns).
const maxRateLimitedIPs = 10_000

// bodyReadDeadline gives a non-streaming request hc.ReadTimeout to deliver its
// body. It is per request, not the server's ReadTimeout, because that one would
// also cut the long-lived event streams. net/http resets the connection's read
// deadline before the next request, so this does not leak into keep-alives.
func bodyReadDeadline(d time.Duration) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			// An error here means the writer cannot set deadlines (a test
			// recorder); the server's other timeouts still hold.
			_ = http.NewResponseController(c.Response().Writer).SetReadDeadline(time.Now().Add(d))
			return next(c)
		}
	}
}

// clientIPExtractor tells echo where a request comes from (c.RealIP), for the
// rate limit and the per-address stream cap. X-Forwarded-For is believed only
// from the configured proxies: any client can write that header, so trusting
// it from anyone would let one client pose as many. Echo's own defaults trust
// every private network; here nothing is trusted unless configured.
func clientIPExtractor(trusted []netip.Prefix) echo.IPExtractor {
	if len(trusted) == 0 {
		return echo.ExtractIPDirect()
	}
	opts := []echo.TrustOption{echo.TrustLoopback(false), echo.TrustLinkLocal(false), echo.TrustPrivateNet(false)}
	for _, p := range trusted {
		opts = append(opts, echo.TrustIPRange(&net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}))
	}
	return echo.ExtractIPFromXFFHeader(opts...)
}

// ipRateLimiter is one token bucket per client IP, the buckets held in a
// bounded LRU so a flood of source addresses cannot grow memory without end.
type ipRateLimiter struct {
	limit rate.Limit
	burst int

	mu      sync.Mutex
	buckets *simplelru.LRU[string, *rate.Limiter]
}

func newIPRateLimiter(perSecond, burst uint, size int) *ipRateLimiter {
	buckets, _ := simplelru.NewLRU[string, *rate.Limiter](size, nil) // only a size < 1 fails
	return &ipRateLimiter{limit: rate.Limit(perSecond), burst: int(burst), buckets: buckets}
}

// reserve takes a token for ip and says how long the client must wait when
// there is none (0: go ahead).
func (l *ipRateLimiter) reserve(ip string, now time.Time) time.Duration {
	l.mu.Lock()
	lim, ok := l.buckets.Get(ip)
	if !ok {
		lim = rate.NewLimiter(l.limit, l.burst)
		l.buckets.Add(ip, lim)
	}
	l.mu.Unlock()
	r := lim.ReserveN(now, 1)
	if !r.OK() {
		return time.Second // no wait would do (config validation rules it out): the shortest Retry-After
	}
	if d := r.DelayFrom(now); d > 0 {
		r.CancelAt(now) // a refused request must not use up a future token
		return d
	}
	return 0
}

// rateLimit answers 429 with Retry-After (whole seconds, at least 1) when the
// client IP has used up its burst.
func rateLimit(l *ipRateLimiter) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			if wait := l.reserve(c.RealIP(), time.Now()); wait > 0 {
				c.Response().Header().Set("Retry-After", strconv.Itoa(max(1, int(math.Ceil(wait.Seconds())))))
				return apiError(http.StatusTooManyRequests, "rate_limited", "too many requests from this address; retry later")
			}
			return next(c)
		}
	}
}
