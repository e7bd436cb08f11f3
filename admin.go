package main

import (
	"net/http"
	"net/http/pprof"
	"strings"
	"sync/atomic"
	"time"

	"github.com/labstack/echo/v4"
)

// The ops port's /admin tree (behind the admin token), pprof beside it,
// and the admin handlers the core owns.

// adminTree is the ops port's /admin/ routes, behind the admin token. From
// phase 2 it serves the boot timeline and answers the rest 503; phase 15,
// once Redis, the jobs client and the features' dependencies exist, swaps in
// the whole tree. Their Redis and database calls share one request budget,
// like the API's.
type adminTree struct{ current atomic.Pointer[echo.Echo] }

// mount makes routes (with the timeline) the tree; without a token there is
// no tree, and /admin/ answers 404.
func (t *adminTree) mount(e *echo.Echo, adminToken string, budget time.Duration, lc *Lifecycle, diag *diagnostics, routes func(*echo.Group)) {
	if adminToken != "" {
		g := e.Group("/admin", requireBearer(adminToken), withDeadline(budget))
		g.Match(getHead(), "/lifecycle", handleTimeline(lc))
		addDiagnosticsRoutes(g, diag)
		routes(g)
	}
	t.current.Store(e)
}

func (t *adminTree) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	t.current.Load().ServeHTTP(w, r)
}

// adminStarting is the tree until phase 15.
func adminStarting(g *echo.Group) {
	g.Any("/*", func(echo.Context) error {
		return apiError(http.StatusServiceUnavailable, "starting", "available once the boot has reached phase apiListener")
	})
}

// adminRoutes is the whole tree: the features' admin routes (the cluster's
// workers, manual jobs, …).
func adminRoutes(features []feature, d routeDeps) func(*echo.Group) {
	return func(g *echo.Group) {
		for _, f := range features {
			for _, r := range f.routes {
				if r.admin {
					h := r.handler(d.usedBy(f))
					for _, method := range r.methods() {
						g.Add(method, strings.TrimPrefix(r.path, "/admin"), h)
					}
				}
			}
		}
	}
}

// addPprofRoutes serves net/http/pprof behind the admin token: profiles show
// code paths and memory, and a CPU profile costs the instance while it runs.
// The handlers are mounted one by one, never via http.DefaultServeMux.
func addPprofRoutes(g *echo.Group) {
	g.GET("/", echo.WrapHandler(http.HandlerFunc(pprof.Index)))
	g.GET("/*", echo.WrapHandler(http.HandlerFunc(pprof.Index))) // heap, allocs, goroutine, block, mutex …
	g.GET("/cmdline", echo.WrapHandler(http.HandlerFunc(pprof.Cmdline)))
	g.GET("/profile", echo.WrapHandler(http.HandlerFunc(pprof.Profile)))
	g.GET("/symbol", echo.WrapHandler(http.HandlerFunc(pprof.Symbol)))
	g.POST("/symbol", echo.WrapHandler(http.HandlerFunc(pprof.Symbol)))
	g.GET("/trace", echo.WrapHandler(http.HandlerFunc(pprof.Trace)))
}

// ---------------------------------------------------------------------------
// Handlers

// handleTimeline is GET /admin/lifecycle: the boot timeline and the state.
func handleTimeline(lc *Lifecycle) echo.HandlerFunc {
	return func(c echo.Context) error {
		return c.JSON(http.StatusOK, map[string]any{
			"state":     lc.State().String(),
			"uptimeSec": int64(lc.Uptime().Seconds()),
			"phases":    lc.Timeline(),
		})
	}
}
