package main

import (
	"container/list"
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
	"net/netip"
	"slices"
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
	capped    *capListener // nil without a cap
}

// connCap bounds a listener's open connections; the zero value does not.
// Every connection costs a goroutine and its buffers (about 30 KB under
// overload), and a client past its timeout opens another while the first is
// still queued: uncapped, an overload grows the process until the memory
// limit kills it, on every instance at once.
//
// At the cap a new connection takes the place of one that does nothing
// (victim): one silent for silentGrace since it was accepted, else the
// keep-alive connection idle the longest. So a client holding the cap's worth
// of keep-alive connections starves nobody, and connections that never send a
// header hold a newcomer back by silentGrace, not by the header timeout. Only
// while every connection is in a request (or silent for less than
// silentGrace) does the listener stop accepting, as HAProxy and nginx do at
// maxconn: new connections wait in the kernel's accept queue, and past its
// length their SYNs are dropped and retried by the client, none of it in this
// process's memory. Probes are unaffected: they use the ops port, which has
// no cap.
type connCap struct {
	max         int
	perClient   int            // one client address's open connections, at most (0: no bound)
	trusted     []netip.Prefix // load balancers: every connection through one has its address, so none is bounded
	silentGrace time.Duration  // a connection without a whole header this long after its accept can be closed at the cap

	open      prometheus.Gauge       // the connections open now
	reclaimed *prometheus.CounterVec // closed at the cap to make room, by state: idle or silent
	refused   prometheus.Counter     // closed at once: their address had perClient open
}

// apiConnCap is the API listener's cap, from the settings.
func apiConnCap(hc httpConfig, m *metrics) connCap {
	return connCap{max: int(hc.MaxConns), perClient: int(hc.MaxConnsPerClient), trusted: hc.TrustedProxies,
		silentGrace: silentConnGrace, open: m.apiConns, reclaimed: m.apiConnsReclaimed, refused: m.apiConnsRefused}
}

// capListener enforces a connCap. Its connections are still TCP connections:
// the event stream sizes its socket's send buffer (limitSendBuffer), which
// netutil.LimitListener's wrapper would hide. Accept is never called twice at
// once (http.Server.Serve's loop calls it).
type capListener struct {
	*net.TCPListener
	connCap
	wake      chan struct{} // a connection was closed or went idle: a waiting Accept looks again
	done      chan struct{} // closed by Close: a waiting Accept gives up
	closeOnce sync.Once

	mu      sync.Mutex
	open    int                // connections accepted and not yet closed
	silent  list.List          // *cappedConn without a whole request header yet, the earliest accepted first
	idle    list.List          // *cappedConn between requests, the longest idle first
	perAddr map[netip.Addr]int // open connections of each address under perClient

	silentClosed, silentReported int // silent connections closed to make room: in all, and when the readiness check last looked
}

// errClientBound is a connection whose address already holds perClient.
var errClientBound = errors.New("the client address holds its share of the connections")

func newCapListener(ln *net.TCPListener, c connCap) *capListener {
	return &capListener{TCPListener: ln, connCap: c, wake: make(chan struct{}, 1), done: make(chan struct{}), perAddr: map[netip.Addr]int{}}
}

// Accept returns the next connection that gets a slot. It takes one from the
// kernel's queue only when there is room, so that a connection is closed to
// make room only for a client that is waiting. A connection whose address
// already holds perClient is closed at once, unanswered: answering it 503
// would first mean reading its request, one more wait on a client that
// already holds its share, and a response written before the request is read
// can be lost to the reset that closing a socket with unread data sends.
func (l *capListener) Accept() (net.Conn, error) {
	for {
		if err := l.awaitRoom(); err != nil {
			return nil, err
		}
		tc, err := l.AcceptTCP()
		if err != nil {
			return nil, err
		}
		c, err := l.admit(tc)
		if err == nil {
			return c, nil
		}
		tc.Close()
		if !errors.Is(err, errClientBound) {
			return nil, err
		}
		l.refused.Inc()
	}
}

func (l *capListener) Close() error {
	l.closeOnce.Do(func() { close(l.done) })
	return l.TCPListener.Close()
}

// awaitRoom returns once a slot is free or a connection can be closed to free
// one.
func (l *capListener) awaitRoom() error {
	for {
		l.mu.Lock()
		victim, retryIn := l.victim(time.Now())
		room := l.open < l.max || victim != nil
		l.mu.Unlock()
		if room {
			return nil
		}
		if err := l.waitForRoom(retryIn); err != nil {
			return err
		}
	}
}

// admit books tc on a slot, closing a connection to free one at the cap.
func (l *capListener) admit(tc *net.TCPConn) (*cappedConn, error) {
	var addr netip.Addr
	if a, ok := tc.RemoteAddr().(*net.TCPAddr); ok {
		addr = a.AddrPort().Addr().Unmap()
	}
	bounded := l.perClient > 0 && !slices.ContainsFunc(l.trusted, func(p netip.Prefix) bool { return p.Contains(addr) })
	for {
		c, victim, retryIn, err := l.book(tc, addr, bounded, time.Now())
		if victim != nil {
			// Outside the lock. net/http's read on it fails and it forgets the
			// connection. An idle one's client may have just sent a request:
			// the same race as the idle timeout's, which HTTP clients retry.
			victim.TCPConn.Close()
		}
		if c != nil || err != nil {
			return c, err
		}
		// The room awaitRoom saw is gone (the idle connection got a request):
		// tc waits, in hand.
		if err := l.waitForRoom(retryIn); err != nil {
			return nil, err
		}
	}
}

// book is admit's step under the lock: tc is booked, silent from now on, on a
// free slot or on victim's; or it is refused; or it must wait retryIn (0: no
// silent connection, wait for a wake-up).
func (l *capListener) book(tc *net.TCPConn, addr netip.Addr, bounded bool, now time.Time) (c, victim *cappedConn, retryIn time.Duration, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if bounded && l.perAddr[addr] >= l.perClient {
		return nil, nil, 0, errClientBound
	}
	if l.open >= l.max {
		if victim, retryIn = l.victim(now); victim == nil {
			return nil, nil, retryIn, nil
		}
		state := "idle"
		if victim.queue == &l.silent {
			state = "silent"
			l.silentClosed++
		}
		l.reclaimed.WithLabelValues(state).Inc()
		l.forget(victim)
	}
	c = &cappedConn{TCPConn: tc, l: l, addr: addr, bounded: bounded}
	if bounded {
		l.perAddr[addr]++
	}
	l.open++
	l.enqueue(c, &l.silent, now)
	return c, victim, 0, nil
}

// victim is the connection to close when a slot is needed: the earliest
// silent one past its grace (a preconnect nobody used, or a slow-header
// attack), else the one idle the longest (the least likely to be reused
// soon). With neither it says how long until the earliest silent one is past
// its grace (0: none is silent). l.mu is held.
func (l *capListener) victim(now time.Time) (*cappedConn, time.Duration) {
	var retryIn time.Duration
	if e := l.silent.Front(); e != nil {
		c := e.Value.(*cappedConn)
		silentFor := now.Sub(c.since)
		if silentFor >= l.silentGrace {
			return c, 0
		}
		retryIn = l.silentGrace - silentFor
	}
	if e := l.idle.Front(); e != nil {
		return e.Value.(*cappedConn), 0
	}
	return nil, retryIn
}

// waitForRoom returns when a slot may be free or a connection may be closed
// to free one: one was closed or went idle, after has passed (the earliest
// silent connection's grace; 0: no timer), or the listener was closed.
func (l *capListener) waitForRoom(after time.Duration) error {
	var graceOver <-chan time.Time
	if after > 0 {
		t := time.NewTimer(after)
		defer t.Stop()
		graceOver = t.C
	}
	select {
	case <-l.wake:
	case <-graceOver:
	case <-l.done:
		return net.ErrClosed
	}
	return nil
}

// track is the server's ConnState hook: it keeps the queues of connections
// that may be closed to make room. One in a request, hijacked or closed is in
// neither; a new one was queued as silent by book.
func (l *capListener) track(nc net.Conn, state http.ConnState) {
	c, ok := nc.(*cappedConn)
	if !ok || state == http.StateNew {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if c.gone {
		return
	}
	l.dequeue(c)
	if state == http.StateIdle {
		l.enqueue(c, &l.idle, time.Now())
		l.signal()
	}
}

// release gives back the slot of a connection that was closed.
func (l *capListener) release(c *cappedConn) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !c.gone {
		l.forget(c)
		l.signal()
	}
}

// forget takes c out of the books, once, and frees its slot; l.mu is held.
func (l *capListener) forget(c *cappedConn) {
	c.gone = true
	l.open--
	l.dequeue(c)
	if c.bounded {
		if l.perAddr[c.addr]--; l.perAddr[c.addr] == 0 {
			delete(l.perAddr, c.addr) // the map holds the addresses with connections, no more
		}
	}
}

func (l *capListener) enqueue(c *cappedConn, q *list.List, now time.Time) {
	c.since, c.queue, c.elem = now, q, q.PushBack(c)
}

func (l *capListener) dequeue(c *cappedConn) {
	if c.queue != nil {
		c.queue.Remove(c.elem)
		c.queue, c.elem = nil, nil
	}
}

// signal wakes a waiting Accept; a wake-up already pending will do.
func (l *capListener) signal() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// registerConnectionsCheck shows the API port's connections in the readiness
// body as apiConnections (connectionsCheck); it never gates.
func (s *httpServer) registerConnectionsCheck(rd *readiness) {
	if s.capped == nil {
		rd.RegisterSkipped("apiConnections", "KUMIKO_API_MAX_CONNS is 0: no cap")
		return
	}
	rd.RegisterReadinessCheck("apiConnections", false, s.capped.connectionsCheck)
}

// connectionsCheck shows the cap's connections by state. It fails, as degraded,
// only when silent connections were closed to make room since it last ran:
// something holds connections and sends no request (a slow-header flood, or
// preconnects nobody uses). It never gates. Idle connections are always
// closed to make room and silent ones after silentGrace, so they hold no
// client back for longer; what can still fill the cap is requests in flight,
// and an instance that is merely busy must stay ready, or under a real
// overload every instance would leave the load balancer at once.
func (l *capListener) connectionsCheck(context.Context) checkResult {
	l.mu.Lock()
	detail := map[string]any{"open": l.open, "max": l.max, "idle": l.idle.Len(), "silent": l.silent.Len()}
	closed := l.silentClosed - l.silentReported
	l.silentReported = l.silentClosed
	l.mu.Unlock()
	if closed > 0 {
		detail["silentClosed"] = closed
		return failedResult(fmt.Errorf("at the cap, %d connections that sent no request header for %s were closed to make room", closed, l.silentGrace), detail)
	}
	return okResult(detail)
}

// cappedConn gives its slot back when it is closed, once, however often
// Close is called (net/http and a drain may both close it).
type cappedConn struct {
	*net.TCPConn
	l       *capListener
	addr    netip.Addr
	bounded bool // counted in l.perAddr

	// Guarded by l.mu.
	since time.Time     // when it was accepted (silent) or went idle
	queue *list.List    // l.silent, l.idle, or nil while in a request
	elem  *list.Element // its place in queue
	gone  bool          // out of the books: its slot was given back or passed on
}

func (c *cappedConn) Close() error {
	err := c.TCPConn.Close()
	c.l.release(c)
	return err
}

// listenHTTP binds addr and serves h on it from one owned goroutine. A Serve
// failure other than a normal close is reported to failed (the process then
// shuts down: a server that cannot accept is not serving). Its goroutines
// and its requests' contexts carry ctx's pprof labels and component=<c>;
// ctx's end ends nothing.
func listenHTTP(ctx context.Context, c component, addr string, h http.Handler, hc httpConfig, conns connCap, log *logrus.Logger, failed func(error)) (*httpServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("binding the %s listener: %w", c, err)
	}
	var capped *capListener
	if conns.max > 0 {
		capped = newCapListener(ln.(*net.TCPListener), conns) // net.Listen("tcp") is always one
		ln = capped
	}
	base := context.WithoutCancel(ctx)
	silent := &silentConns{since: map[net.Conn]time.Time{}}
	clients := &traffic{since: time.Now()}
	connState := func(c net.Conn, state http.ConnState) {
		silent.track(c, state)
		if capped != nil {
			capped.track(c, state)
		}
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
			BaseContext: func(net.Listener) context.Context { return withLabel(base, labelComponent, c.String()) },
			// A handler that must tune its socket (the event stream) finds it here.
			ConnContext: func(ctx context.Context, c net.Conn) context.Context { return context.WithValue(ctx, connKey{}, c) },
			// net/http's own complaints (bad handshakes, header timeouts) join the structured log.
			ErrorLog: stdlog.New(warnWriter{c.log(log)}, "", 0)},
		addr:    ln.Addr(),
		done:    make(chan struct{}),
		silent:  silent,
		traffic: clients,
		capped:  capped,
	}
	go func() {
		defer close(s.done)
		labelled(base, labelComponent, c.String(), func() { // its connections' goroutines inherit the label
			if err := s.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				failed(fmt.Errorf("%s listener stopped serving: %w", c, err))
			}
		})
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
