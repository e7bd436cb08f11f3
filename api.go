package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	stdlog "log"
	"math"
	"net"
	"net/http"
	"net/http/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/labstack/echo/v4"
	"github.com/labstack/echo/v4/middleware"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
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

// adminTree is the ops port's /admin/ routes, behind the admin token. From
// phase 2 it serves the boot timeline and answers the rest 503; phase 15,
// once Redis, the jobs client and the features' dependencies exist, swaps in
// the whole tree. Their Redis and database calls share one request budget,
// like the API's.
type adminTree struct{ current atomic.Pointer[echo.Echo] }

// mount makes routes (with the timeline) the tree; without a token there is
// no tree, and /admin/ answers 404.
func (t *adminTree) mount(e *echo.Echo, adminToken string, budget time.Duration, lc *Lifecycle, routes func(*echo.Group)) {
	if adminToken != "" {
		g := e.Group("/admin", requireBearer(adminToken), withDeadline(budget))
		g.Match(getHead(), "/lifecycle", handleTimeline(lc))
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

// adminRoutes is the whole tree: the cluster's workers, manual jobs, and the
// features' admin routes.
func adminRoutes(rdb *redis.Client, j *jobs, features []feature, d routeDeps) func(*echo.Group) {
	return func(g *echo.Group) {
		g.Match(getHead(), "/workers", handleWorkers(rdb))
		g.POST("/jobs/:name/run", handleRunJob(j))
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

// addAPIRoutes serves the features on the API listener (bound in phase 15).
// Requests are measured and counted in flight; streams are not, because the
// drain ends them instead of waiting for them. Feature routes and the page are
// rate-limited per client IP; the health routes are not (probes must always
// get through). Past the instance's capacity the feature routes that are not
// long-running are shed by the concurrency limit (admission.go), after the
// per-IP limit so one client's excess never takes the others' room; health,
// the page and the streams never are. Readiness here tells status only:
// details are on the ops port.
func addAPIRoutes(e *echo.Echo, lc *Lifecycle, rd *readiness, features []feature, d routeDeps, hc httpConfig,
	admission *concurrencyLimiter, backlog *backlogWatch, inFlight *atomic.Int64, rejecting *atomic.Bool, tracer trace.Tracer) {
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
	e.Match(getHead(), "/", handleDashboard(), limit...)
	for _, f := range features {
		for _, r := range f.routes {
			if r.admin {
				continue // on the ops port: adminRoutes
			}
			chain := []echo.MiddlewareFunc{admitWhenServing(lc, rejecting)}
			if !r.streaming {
				// Measured first, so the 429s are counted too.
				chain = append(chain, observeRequests(m))
			}
			chain = append(chain, limit...)
			if !r.streaming && !r.longRunning {
				chain = append(chain, admit...)
			}
			if !r.streaming {
				chain = append(chain, bodyReadDeadline(hc.ReadTimeout), trackInFlight(inFlight, m), traceRequests(tracer), backlog.sayWhenDelayed())
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

// ---------------------------------------------------------------------------
// Servers

// httpServer is one listener and the http.Server on it. The listener is bound
// by listenHTTP itself, so a port in use is an error of the phase that asked
// for it, not of some goroutine later.
type httpServer struct {
	component component
	srv       *http.Server
	addr      net.Addr
	done      chan struct{} // closed when Serve has returned
	silent    *silentConns
	traffic   *traffic
}

// connCap bounds a listener's open connections; the zero value does not.
// Every connection costs a goroutine and its buffers (about 30 KB under
// overload), and a client past its timeout opens another while the first is
// still queued: uncapped, an overload grows the process until the memory
// limit kills it, on every instance at once. At the cap the listener stops
// accepting (capListener, as HAProxy and nginx do at maxconn): new
// connections wait in the kernel's accept queue, and past its length their
// SYNs are dropped and retried by the client, none of it in this process's
// memory.
// Probes are unaffected: they use the ops port, which has no cap.
type connCap struct {
	max  int
	open prometheus.Gauge // the connections open now
}

// capListener accepts a connection only while fewer than cap(slots) are
// open. It is netutil.LimitListener's logic, but the connections it returns
// are still TCP connections: the event stream sizes its socket's send buffer
// (limitSendBuffer), and netutil's wrapper hides the socket behind net.Conn.
type capListener struct {
	*net.TCPListener
	slots     chan struct{} // one per open connection
	done      chan struct{} // closed by Close: a waiting Accept gives up
	closeOnce sync.Once
}

func newCapListener(ln *net.TCPListener, max int) *capListener {
	return &capListener{TCPListener: ln, slots: make(chan struct{}, max), done: make(chan struct{})}
}

// Accept waits for a free slot, then for a connection.
func (l *capListener) Accept() (net.Conn, error) {
	select {
	case l.slots <- struct{}{}:
	case <-l.done:
		return nil, net.ErrClosed
	}
	c, err := l.AcceptTCP()
	if err != nil {
		<-l.slots
		return nil, err
	}
	return &cappedConn{TCPConn: c, release: func() { <-l.slots }}, nil
}

func (l *capListener) Close() error {
	l.closeOnce.Do(func() { close(l.done) })
	return l.TCPListener.Close()
}

// cappedConn gives its slot back when it is closed, once, however often
// Close is called (net/http and a drain may both close it).
type cappedConn struct {
	*net.TCPConn
	release     func()
	releaseOnce sync.Once
}

func (c *cappedConn) Close() error {
	err := c.TCPConn.Close()
	c.releaseOnce.Do(c.release)
	return err
}

// listenHTTP binds addr and serves h on it from one owned goroutine. A Serve
// failure other than a normal close is reported to failed (the process then
// shuts down: a server that cannot accept is not serving).
func listenHTTP(c component, addr string, h http.Handler, hc httpConfig, conns connCap, log *logrus.Logger, failed func(error)) (*httpServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("binding the %s listener: %w", c, err)
	}
	if conns.max > 0 {
		ln = newCapListener(ln.(*net.TCPListener), conns.max) // net.Listen("tcp") is always one
	}
	silent := &silentConns{since: map[net.Conn]time.Time{}}
	clients := &traffic{since: time.Now()}
	connState := func(c net.Conn, state http.ConnState) {
		silent.track(c, state)
		switch {
		case state == http.StateNew:
			clients.seen()
			if conns.open != nil {
				conns.open.Inc()
			}
		case conns.open != nil && (state == http.StateClosed || state == http.StateHijacked):
			conns.open.Dec()
		}
	}
	s := &httpServer{
		component: c,
		// No server-wide ReadTimeout or WriteTimeout: they would cut the event
		// streams. Bodies get a per-request deadline (bodyReadDeadline), stream
		// writes their own write deadline.
		srv: &http.Server{Handler: clients.observe(h), ReadHeaderTimeout: hc.ReadHeaderTimeout, IdleTimeout: hc.IdleTimeout,
			MaxHeaderBytes: maxHeaderBytes, ConnState: connState,
			// A handler that must tune its socket (the event stream) finds it here.
			ConnContext: func(ctx context.Context, c net.Conn) context.Context { return context.WithValue(ctx, connKey{}, c) },
			// net/http's own complaints (bad handshakes, header timeouts) join the structured log.
			ErrorLog: stdlog.New(warnWriter{c.log(log)}, "", 0)},
		addr:    ln.Addr(),
		done:    make(chan struct{}),
		silent:  silent,
		traffic: clients,
	}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			failed(fmt.Errorf("%s listener stopped serving: %w", c, err))
		}
	}()
	c.log(log).WithField("addr", s.addr.String()).Info("listening")
	return s, nil
}

// traffic remembers when a client last came: a new connection, or a request
// that is not a health check (probes ask on their own schedule whether or
// not traffic is routed here). The adaptive linger reads it to tell when the
// load balancer has stopped sending.
type traffic struct {
	since time.Time    // the listener's start: last counts from it, on the monotonic clock
	last  atomic.Int64 // when a client last came, as nanoseconds after since plus 1; 0: nobody yet
}

func (t *traffic) seen() { t.last.Store(int64(time.Since(t.since)) + 1) }

// quietFor is how long no client came; since the start when none ever did.
func (t *traffic) quietFor() time.Duration {
	last := t.last.Load()
	if last == 0 {
		return time.Duration(math.MaxInt64)
	}
	return time.Since(t.since) - time.Duration(last-1)
}

func (t *traffic) observe(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasPrefix(r.URL.Path, "/health") {
			t.seen()
		}
		h.ServeHTTP(w, r)
	})
}

// connKey is the request context key of the connection a request came on.
type connKey struct{}

// silentConns are the connections that have not sent a whole request header
// yet (http.StateNew), each with the moment it was accepted.
// http.Server.Shutdown counts such a connection as busy for its first 5
// seconds, in case a request is on its way; the drain closes the ones that
// stayed silent instead (closeSilent), so a browser's or a pool's unused
// preconnect does not hold the exit back.
type silentConns struct {
	mu    sync.Mutex
	since map[net.Conn]time.Time
}

// track is the server's ConnState hook.
func (s *silentConns) track(c net.Conn, state http.ConnState) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if state == http.StateNew {
		s.since[c] = time.Now()
	} else {
		delete(s.since, c)
	}
}

// closeSilent closes the connections silent for longer than grace and says how many.
func (s *silentConns) closeSilent(grace time.Duration) (closed int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c, since := range s.since {
		if time.Since(since) > grace {
			c.Close() // net/http's read fails: it forgets the connection (StateClosed)
			delete(s.since, c)
			closed++
		}
	}
	return closed
}

// warnWriter turns each line written to it into a structured warning,
// synchronously (logrus's WriterLevel would start a goroutine nobody stops).
type warnWriter struct{ log *logrus.Entry }

func (w warnWriter) Write(p []byte) (int, error) {
	w.log.Warn(strings.TrimSpace(string(p)))
	return len(p), nil
}

// newEcho is the echo instance every listener uses: JSON errors, panics
// answered with a 500 for that request only.
func newEcho(log *logrus.Logger, m *metrics, c component) *echo.Echo {
	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	e.HTTPErrorHandler = jsonErrorHandler(c.log(log))
	e.Use(recoverPanics(log, m, c))
	return e
}

// recoverPanics answers a panicking handler with a 500, logged with its stack
// and counted; the process goes on serving.
func recoverPanics(log *logrus.Logger, m *metrics, c component) echo.MiddlewareFunc {
	return middleware.RecoverWithConfig(middleware.RecoverConfig{
		DisableStackAll: true,
		LogErrorFunc: func(ec echo.Context, err error, stack []byte) error {
			m.panics.WithLabelValues(c.String()).Inc()
			c.log(log).WithFields(logrus.Fields{"route": ec.Path(), "stack": string(stack)}).WithError(err).Error("handler panicked")
			return echo.NewHTTPError(http.StatusInternalServerError, "internal error")
		},
	})
}

// ---------------------------------------------------------------------------
// Middleware

// observeRequests counts requests by route template (never the raw path: its
// cardinality is unbounded) and tracks the requests in flight.
func observeRequests(m *metrics) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			start := time.Now()
			if err := next(c); err != nil {
				c.Error(err)
			}
			route := c.Path()
			if route == "" {
				route = "unmatched"
			}
			m.httpRequests.WithLabelValues(route, strconv.Itoa(c.Response().Status)).Inc()
			m.httpDuration.WithLabelValues(route).Observe(time.Since(start).Seconds())
			return nil
		}
	}
}

// trackInFlight counts the API requests being served, for the drain's
// force-close warning and for kumiko_http_requests_in_flight.
func trackInFlight(n *atomic.Int64, m *metrics) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			n.Add(1)
			m.httpInFlight.Inc()
			defer func() {
				n.Add(-1)
				m.httpInFlight.Dec()
			}()
			return next(c)
		}
	}
}

// withDeadline bounds a request's context, and with it every dependency call
// the handler makes on it. Only for handlers that neither stream nor wait by
// design (/api/slow).
func withDeadline(d time.Duration) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			ctx, cancel := context.WithTimeout(c.Request().Context(), d)
			defer cancel()
			c.SetRequest(c.Request().WithContext(ctx))
			return next(c)
		}
	}
}

// admitWhenServing answers 503 with Retry-After while the process is not
// serving. During the linger no check is needed: keep-alives are off from its
// first moment and the listener closes after it, so the only requests that
// still arrive are the ones the linger is there to serve. With
// KUMIKO_DRAIN_REJECT=retry-after the port stays open past the linger, and
// from then on (rejecting) a new request is told to retry elsewhere.
func admitWhenServing(lc *Lifecycle, rejecting *atomic.Bool) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			if s := lc.State(); s == StateStarting || s == StateStopped {
				c.Response().Header().Set("Retry-After", "1")
				return apiError(http.StatusServiceUnavailable, "unavailable", "instance is "+s.String())
			}
			if rejecting.Load() {
				c.Response().Header().Set("Retry-After", "1")
				return apiError(http.StatusServiceUnavailable, "draining", "this instance is shutting down; retry, another one answers")
			}
			return next(c)
		}
	}
}

// requireBearer compares SHA-256 digests of the presented token and of the
// expected one: both are always 32 bytes, so the comparison time does not
// tell the token's length (ConstantTimeCompare returns at once on a length
// mismatch).
func requireBearer(token string) echo.MiddlewareFunc {
	want := sha256.Sum256([]byte(token))
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			presented, _ := bearerToken(c.Request())
			got := sha256.Sum256([]byte(presented))
			if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
				c.Response().Header().Set(echo.HeaderWWWAuthenticate, "Bearer")
				return apiError(http.StatusUnauthorized, "unauthorized", "admin routes need Authorization: Bearer <KUMIKO_ADMIN_TOKEN>")
			}
			return next(c)
		}
	}
}

// bearerToken is the token of an Authorization: Bearer header, and whether
// there is one. The scheme is matched case-insensitively and may be followed
// by more than one space (RFC 9110 §11.1, §11.4): "bearer x" is the same
// credential as "Bearer x". An empty token is no token.
func bearerToken(r *http.Request) (string, bool) {
	scheme, token, found := strings.Cut(r.Header.Get(echo.HeaderAuthorization), " ")
	token = strings.TrimLeft(token, " ")
	if !found || !strings.EqualFold(scheme, "Bearer") || token == "" {
		return "", false
	}
	return token, true
}

// ---------------------------------------------------------------------------
// Errors: every error body is {"error":{"code","message"}}.

type errorBody struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// apiError is an error a handler returns to answer with status and a JSON body.
func apiError(status int, code, message string) error {
	return echo.NewHTTPError(status, errorBody{Code: code, Message: message})
}

func jsonErrorHandler(log *logrus.Entry) echo.HTTPErrorHandler {
	return func(err error, c echo.Context) {
		if c.Response().Committed {
			return
		}
		status, body := http.StatusInternalServerError, errorBody{Code: "internal", Message: "internal error"}
		var he *echo.HTTPError
		if errors.As(err, &he) {
			status = he.Code
			switch msg := he.Message.(type) {
			case errorBody:
				body = msg
			default:
				body = errorBody{Code: codeFor(status), Message: fmt.Sprint(msg)}
			}
		} else if dependencyUnavailable(err) || errors.Is(err, context.Canceled) {
			// A dependency that restarts or hangs is no bug here, and the client
			// should come back; a request whose client left gets the same answer.
			status, body = http.StatusServiceUnavailable, errorBody{Code: "unavailable", Message: "a dependency did not answer in time; retry shortly"}
			c.Response().Header().Set("Retry-After", "1")
			log.WithField("route", c.Path()).WithError(err).Warn("dependency unavailable")
		} else {
			// Not an answer a handler chose: log it, tell the client nothing internal.
			log.WithField("route", c.Path()).WithError(err).Error("request failed")
		}
		if err := c.JSON(status, map[string]errorBody{"error": body}); err != nil {
			log.WithError(err).Debug("writing the error response")
		}
	}
}

// dependencyUnavailable reports an error that is no fault of the request: a
// dependency that did not answer within the request's budget, a database
// that restarts or refuses connections, a statement the server cancelled
// (statement_timeout, lock_timeout). The API answers it 503 with
// Retry-After, never 500.
func dependencyUnavailable(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "57014", "55P03", "53300", "53400": // query_canceled, lock_not_available, too_many_connections, configuration_limit_exceeded
			return true
		}
		return serverGoingAway(pgErr.Code)
	}
	var netErr net.Error
	return errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err) || connectionLost(err) ||
		errors.Is(err, redis.ErrPoolTimeout) || (errors.As(err, &netErr) && netErr.Timeout())
}

func codeFor(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "bad_request"
	case http.StatusUnauthorized:
		return "unauthorized"
	case http.StatusNotFound:
		return "not_found"
	case http.StatusMethodNotAllowed:
		return "method_not_allowed"
	case http.StatusRequestTimeout:
		return "request_timeout"
	case http.StatusTooManyRequests:
		return "rate_limited"
	case http.StatusRequestEntityTooLarge:
		return "payload_too_large"
	case http.StatusServiceUnavailable:
		return "unavailable"
	case http.StatusInternalServerError:
		return "internal"
	}
	return "error"
}

// ---------------------------------------------------------------------------
// Handlers

// handleWorkers is GET /admin/workers: the live workers of every instance
// (their heartbeat keys) and the current leader.
func handleWorkers(rdb *redis.Client) echo.HandlerFunc {
	return func(c echo.Context) error {
		cl, err := readCluster(c.Request().Context(), rdb)
		if err != nil {
			return err
		}
		return c.JSON(http.StatusOK, cl)
	}
}

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
