package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
)

// dbConnect is phase 7: the pgx pool, retried with backoff. The pool's release
// and its readiness check are registered as soon as it answers.
func (a *app) dbConnect(ctx context.Context, p *phaseRun) error {
	created, err := a.newPool(ctx, "", 0)
	if err != nil {
		// A malformed URL will not heal with retries.
		return err
	}
	// The readiness probe's own connection is made here too, in the connect
	// window, so the first probe (phase 16) does not pay for a connection.
	probe := &dbProbe{config: created.Config().ConnConfig, pool: created}
	connect := func(ctx context.Context) error {
		if err := created.Ping(ctx); err != nil {
			return err
		}
		return probe.warm(ctx)
	}
	if err := a.connectWithRetry(ctx, p, componentDB, connect); err != nil {
		probe.close()
		created.Close()
		return err
	}
	a.db = created
	// Close waits for acquired connections to be released, so in-flight
	// queries finish first; a hung server holds the drain no longer than
	// poolClose. Past it, what is left is the closing itself (a connection
	// whose query was cancelled waits for the server to answer its cancel
	// request: over 2 s on a busy machine), and the exit closes the sockets,
	// whose sessions the server then ends: best effort, nothing is lost.
	a.lc.RegisterShutdownHook(componentDB, bestEffort(within(a.timeouts.poolClose, func(ctx context.Context) error {
		probe.close()
		return runBounded(ctx, func() error { created.Close(); return nil })
	})))
	a.health.RegisterReadinessCheck(componentDB.String(), true, probe.check)
	return nil
}

// newPool is a pool on DATABASE_URL whose every connection is hardened
// (hardenConnConfig) and named after the instance, plus "/"+role for a pool
// with a role of its own. maxConns 0 keeps the URL's pool_max_conns (or
// pgx's default). Lazy: it connects on first use.
func (a *app) newPool(ctx context.Context, role string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(a.cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("parsing DATABASE_URL: %w", err)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	name := serviceName + "/" + a.cfg.InstanceID
	if role != "" {
		name += "/" + role
	}
	var pool atomic.Pointer[pgxpool.Pool] // set below; the hook may fire while the first ping runs
	hardenConnConfig(cfg.ConnConfig, name, a.timeouts, func() { purgePool(pool.Load()) })
	cfg.AfterRelease = reusable
	created, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("creating the %s pool: %w", cmp.Or(role, "database"), err)
	}
	pool.Store(created)
	return created, nil
}

// hardenConnConfig prepares every connection of the service for a database
// that restarts, fails over or hangs:
//
//   - statement_timeout and lock_timeout bound each statement on the server,
//     where a client's deadline does not reach, and
//     idle_in_transaction_session_timeout each pause inside a transaction: the
//     locks of a frozen or cut-off instance are freed for the others;
//   - a context that ends cuts the socket at once and sends a cancel
//     request, so the server stops the query the client gave up on (pgx's
//     default only cuts the socket: the server would go on scanning);
//   - the first connection that hears the server say goodbye (57P01 on a fast
//     restart, 57P02 after a crash) calls serverGone, which purges the pool:
//     every other pooled connection is just as dead, and would otherwise fail
//     one request each.
func hardenConnConfig(cc *pgx.ConnConfig, appName string, t timeouts, serverGone func()) {
	cc.RuntimeParams["application_name"] = appName
	cc.RuntimeParams["statement_timeout"] = strconv.FormatInt(t.dbStatement.Milliseconds(), 10)
	cc.RuntimeParams["lock_timeout"] = strconv.FormatInt(t.dbLock.Milliseconds(), 10)
	cc.RuntimeParams["idle_in_transaction_session_timeout"] = strconv.FormatInt(t.dbIdleInTx.Milliseconds(), 10)
	cc.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler { return &cancelOnServer{conn: c} }
	closeOnFatal := cc.OnPgError
	cc.OnPgError = func(c *pgconn.PgConn, e *pgconn.PgError) bool {
		if serverGoingAway(e.Code) {
			serverGone()
		}
		return closeOnFatal(c, e)
	}
}

// cancelOnServer is the pgx context handler of every connection. When a
// query's context ends, the socket's deadline is pulled to now, so the caller
// gets its answer within its own budget even from a hung server, and a
// cancel request (on a connection of its own, bounded by cancelGrace) tells
// the server to stop working on it. A connection whose query was cancelled is
// not used again: a cancel request may land late and cancel its next query
// (AfterRelease drops it from the pool).
type cancelOnServer struct{ conn *pgconn.PgConn }

func (h *cancelOnServer) HandleCancel(context.Context) {
	h.conn.Conn().SetDeadline(time.Now())
	go func() { // bounded by cancelGrace; pgx's own handler sends it the same way
		ctx, cancel := context.WithTimeout(context.Background(), cancelGrace)
		defer cancel()
		h.conn.CancelRequest(ctx)
	}()
}

func (h *cancelOnServer) HandleUnwatchAfterCancel() {
	h.conn.CustomData()[cancelledQuery] = true
	h.conn.Conn().SetDeadline(time.Time{})
}

// cancelledQuery marks a connection in its CustomData once a query on it was
// cancelled.
const cancelledQuery = "kumiko.cancelledQuery"

// reusable is the pool's AfterRelease: a connection goes back to the pool
// unless a query on it was cancelled.
func reusable(c *pgx.Conn) bool { return c.PgConn().CustomData()[cancelledQuery] == nil }

// serverGoingAway reports SQLSTATEs with which the server ends a session that
// did nothing wrong: an operator's or a failover's shutdown (57P01), a crash
// of another backend (57P02), a server not accepting connections yet (57P03),
// and class 08, connection exceptions.
func serverGoingAway(code string) bool {
	switch code {
	case "57P01", "57P02", "57P03":
		return true
	}
	return len(code) == 5 && code[:2] == "08"
}

// purgePool closes every idle connection and every busy one once it is
// released; new ones are made on demand.
func purgePool(p *pgxpool.Pool) {
	if p != nil {
		p.Reset()
	}
}

// ---------------------------------------------------------------------------
// The request path

// demo:begin (only the orders demo retries; a bare copy drops it)
// retrySafe runs fn, the database work of one request, and runs it once more
// when the first try failed on the connection rather than on the statement:
// nothing of it reached the server (pgconn.SafeToRetry), the server answered
// that it is going away (57P01 and the like), or the socket broke. fn must be
// idempotent, because a server going away may say so only after it
// committed: the request path reads, and an insert carries the same id both
// times (drawn before the first try), so its unique index tells a second try
// that the first one landed. A lost connection purges the pool first, so the second try gets
// a fresh one. Anything else is returned as it is; the API answers a
// dependency's failure with 503 and Retry-After (dependencyUnavailable).
func retrySafe[T any](ctx context.Context, db *pgxpool.Pool, fn func(context.Context) (T, error)) (T, error) {
	v, err := fn(ctx)
	if err == nil || ctx.Err() != nil {
		return v, err
	}
	lost := connectionLost(err)
	if lost {
		purgePool(db)
	}
	if !lost && !pgconn.SafeToRetry(err) {
		return v, err
	}
	return fn(ctx)
}

// demo:end

// connectionLost reports an error that says the connection, not the
// statement, failed: the server went away, or the socket broke.
func connectionLost(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return serverGoingAway(pgErr.Code)
	}
	var connectErr *pgconn.ConnectError
	return errors.As(err, &connectErr) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, syscall.ECONNREFUSED)
}

// ---------------------------------------------------------------------------
// Readiness

// dbProbe is the readiness check of the database, on a connection of its own:
// a pool emptied by slow queries must not take the instance out of the load
// balancer while the database is fine, and a probe must not wait behind
// them. A restart this connection hears purges the pool too (the OnPgError
// hook), so readiness says 200 again only once the pool can serve. Its
// detail shows the pool's own state. The readiness cache runs one probe at a
// time; the mutex only serializes it with close.
//
// One failed ping after one that answered does not take the instance out:
// the database is every instance's, and a ping past its deadline on a busy
// server fails at every instance at once, so gating on it would empty the
// load balancer for a blip each instance could serve through. Such a failure
// is shown as degraded (Shared); dbFailuresToGate in a row gate.
type dbProbe struct {
	config *pgx.ConnConfig
	pool   *pgxpool.Pool

	mu       sync.Mutex
	conn     *pgx.Conn
	answered bool // a ping of check has answered: its failures may be blips
	failed   int  // pings of check failed since the last that answered
}

// dbFailuresToGate is how many failed pings in a row (a check interval
// apart) make the database a reason not to be ready.
const dbFailuresToGate = 2

func (p *dbProbe) check(ctx context.Context) checkResult {
	p.mu.Lock()
	defer p.mu.Unlock()
	stat := p.pool.Stat()
	detail := map[string]any{"poolConns": stat.TotalConns(), "poolInUse": stat.AcquiredConns(), "poolMax": stat.MaxConns()}
	start := time.Now()
	err := p.ping(ctx)
	detail["latencyMs"] = time.Since(start).Milliseconds()
	if err != nil {
		p.failed++
		detail["failedInARow"] = p.failed
		res := failedResult(err, detail)
		res.Shared = p.answered && p.failed < dbFailuresToGate
		return res
	}
	p.answered, p.failed = true, 0
	return okResult(detail)
}

// ping pings on the probe's connection, connecting first when there is none;
// a connection that failed is dropped, the next probe connects afresh.
func (p *dbProbe) ping(ctx context.Context) error {
	if p.conn == nil {
		conn, err := pgx.ConnectConfig(ctx, p.config)
		if err != nil {
			return fmt.Errorf("connecting the readiness probe: %w", err)
		}
		p.conn = conn
	}
	if err := p.conn.Ping(ctx); err != nil {
		p.dropConn()
		return fmt.Errorf("pinging the database: %w", err)
	}
	return nil
}

// warm makes the probe's connection ahead of the first probe.
func (p *dbProbe) warm(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ping(ctx)
}

func (p *dbProbe) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropConn()
}

// dropConn closes the probe's connection; p.mu is held. The goodbye to the
// server is not waited for longer than cancelGrace: a hung one never reads it.
func (p *dbProbe) dropConn() {
	if p.conn == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), cancelGrace)
	defer cancel()
	p.conn.Close(ctx)
	p.conn = nil
}
