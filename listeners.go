package main

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	stdlog "log"
	"math"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
)

// The listeners: each port bound by the phase that asks for it, the API
// port's connection cap (the oldest idle connection makes room, one address
// gets a share), and the traffic the adaptive linger watches.

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
