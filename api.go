package main

import (
	"net/http"
	"sync/atomic"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/trace"
)

// ---------------------------------------------------------------------------
// Routes: one function per listener, one line per route.

// addOpsRoutes serves probes, metrics and pprof on the ops listener, which is
// open from phase 2 until the very end of the drain. The /admin tree beside
// them is adminTree's.
func addOpsRoutes(e *echo.Echo, rd *readiness, m *metrics, hc httpConfig, adminToken string) {
	e.Use(bodyReadDeadline(hc.ReadTimeout)) // nothing on this port streams
	// HEAD answers like GET (net/http drops the body): monitors and load
	// balancers probe with either.
	e.Match(getHead(), "/health", handleLive())
	e.Match(getHead(), "/health/ready", handleReady(rd, true))
	e.Match(getHead(), "/metrics", echo.WrapHandler(promhttp.HandlerFor(m.registry, promhttp.HandlerOpts{Registry: m.registry})))
	if adminToken != "" { // no token configured: admin routes are off, not open
		addPprofRoutes(e.Group("/debug/pprof", requireBearer(adminToken)))
	}
}

// addAPIRoutes serves the features on the API listener (bound in phase 15).
// Requests are measured and counted in flight; streams are not, because the
// drain ends them instead of waiting for them. Feature routes and the page are
// rate-limited per client IP; the health routes are not (probes must always
// get through). Past the instance's capacity the feature routes that are not
// long-running are shed by the concurrency limit (admission.go), after the
// per-IP limit so one client's excess never takes the others' room; health,
// static pages and the streams never are. Around every request that is not a
// stream come the blocks' own middleware (around: the jobs backlog's
// warning). Readiness here tells status only: details are on the ops port.
func addAPIRoutes(e *echo.Echo, lc *Lifecycle, rd *readiness, features []feature, d routeDeps, hc httpConfig,
	admission *concurrencyLimiter, around []echo.MiddlewareFunc, inFlight *atomic.Int64, rejecting *atomic.Bool, tracer trace.Tracer) {
	m := d.metrics
	var limit []echo.MiddlewareFunc
	if hc.RateLimit > 0 {
		limit = append(limit, rateLimit(newIPRateLimiter(hc.RateLimit, hc.RateBurst, maxRateLimitedIPs)))
	}
	var admit []echo.MiddlewareFunc
	if admission != nil {
		admit = append(admit, admitWithinLimit(admission, m))
	}
	e.Match(getHead(), "/health", handleLive())
	e.Match(getHead(), "/health/ready", handleReady(rd, false))
	for _, f := range features {
		for _, r := range f.routes {
			if r.admin {
				continue // on the ops port: adminRoutes
			}
			if r.static {
				for _, method := range r.methods() {
					e.Add(method, r.path, r.handler(d.usedBy(f)), limit...)
				}
				continue
			}
			chain := []echo.MiddlewareFunc{labelRequests(), admitWhenServing(lc, rejecting)}
			if !r.streaming {
				// Measured first, so the 429s are counted too.
				chain = append(chain, observeRequests(m))
			}
			chain = append(chain, limit...)
			if !r.streaming && !r.longRunning {
				chain = append(chain, admit...)
			}
			if !r.streaming {
				chain = append(chain, bodyReadDeadline(hc.ReadTimeout), trackInFlight(inFlight, m), traceRequests(tracer))
				chain = append(chain, around...)
			}
			h := r.handler(d.usedBy(f))
			for _, method := range r.methods() {
				e.Add(method, r.path, h, chain...)
			}
		}
	}
}

// getHead is the methods of a route that HEAD must answer like GET.
func getHead() []string { return []string{http.MethodGet, http.MethodHead} }

// methods is what a feature route answers: a GET answers HEAD too (net/http
// sends the headers and drops the body), as RFC 9110 asks of every GET.
func (r route) methods() []string {
	if r.method == http.MethodGet {
		return getHead()
	}
	return []string{r.method}
}
