package main

import (
	"cmp"
	"time"
)

// timeouts is every time budget of the process — its deadlines, and how
// often a loop runs or how long a record lives — decided here and nowhere
// else: the configured ones are derived in newTimeouts, the fixed ones are
// the constants below it; boot.go, shutdown.go and the components are given
// theirs. A setting a component uses as it is (a poll interval, a heartbeat
// TTL) is declared once, in config.go's table. What stays in the other files
// is no budget: unit conversions, rounding for a log line or a header, cron
// arithmetic, the admission window (a parameter of its algorithm), the range
// a client may ask for.
type timeouts struct {
	// The boot.
	boot           time.Duration // process start → ready: KUMIKO_STARTUP_TIMEOUT
	phase          time.Duration // any one startup phase: KUMIKO_PHASE_TIMEOUT
	connect        time.Duration // the retry window of a connect phase: KUMIKO_CONNECT_MAX_WAIT
	connectAttempt time.Duration // one attempt, so a blackholed host costs an attempt, not the window

	// The drain.
	shutdown time.Duration // signal → exit: KUMIKO_SHUTDOWN_TIMEOUT
	linger   time.Duration // the longest linger: KUMIKO_LINGER
	// The linger ends earlier once the load balancer has visibly stopped
	// sending: no request for lingerQuiet (KUMIKO_LINGER_QUIET, by default
	// half the probe period), and not before lingerMin, the time it takes to
	// notice the 503 (KUMIKO_READINESS_PROBE_PERIOD).
	lingerMin, lingerQuiet time.Duration
	drain                  time.Duration // steps sseClose and inFlight together: KUMIKO_DRAIN_TIMEOUT
	// sseClose spreads the event streams' reconnects over sseSpreadStep per
	// open stream, at most sseSpread (KUMIKO_SSE_RECONNECT_SPREAD, never more
	// than the drain budget nor what is left of it when the step begins).
	// The goodbyes go out over the first half of that window, so the last
	// stream is closed with half of the drain budget still to spare.
	sseSpread, sseSpreadStep time.Duration
	// Kept back for each release hook still waiting, so one hung hook cannot
	// eat the time the DB pool needs to close.
	hookReserve time.Duration
	// jobsStop bounds the jobs worker's stop, with hookReserve on top: half
	// of what the release hooks are sure to have, so the hooks after it keep
	// theirs. Its first half at most is the soft stop (running jobs may
	// finish), the rest the hard stop (jobs.Stop).
	jobsStop time.Duration

	// Each release bounded on its own, so a hung Redis or PostgreSQL costs
	// the drain seconds, not its whole budget.
	//
	// redisRelease: a best-effort Redis cleanup (heartbeat keys, the leader
	// lock, the dashboard record); what it would delete expires by itself.
	redisRelease time.Duration
	// batchFinish: the outbox batch in hand may commit for this long; then it
	// rolls back and its events stay pending for the next poller.
	batchFinish time.Duration
	// poolClose: the pool closes its connections; a hung server gets no longer.
	poolClose time.Duration

	// Dependencies while serving.
	//
	// request: one API request's database and Redis calls together
	// (KUMIKO_HTTP_DEPENDENCY_TIMEOUT, 5 s). Seconds, because the database is
	// every instance's: a budget of a few round trips (it was 500 ms) turns
	// a shared PostgreSQL that is slow but working into a fleet-wide outage.
	// A hung dependency is still a 503 with Retry-After within it; what keeps
	// the instance from drowning in waiting requests is the admission limit.
	request time.Duration
	// demo:begin (the orders demo's deadlines; scripts/new-service.sh --bare removes this block)
	// search: Meilisearch's share of a search request's budget (half of
	// request); past it, SQL answers instead.
	search time.Duration
	// marker: the idempotency marker in Redis only speeds up what
	// PostgreSQL's unique key decides, so it gives way after this share.
	marker time.Duration
	// commitMargin: an order joins a statement only while its request has
	// this much of its budget left (a fifth of request). A statement takes
	// a few ms; an order taken with less left would most likely be answered
	// after its deadline (still with its 201: once taken, its request waits).
	commitMargin time.Duration
	// orderStatement bounds an order statement once it runs. Its requests
	// wait for it past their own deadlines (each must be answered with what
	// happened to its order), so it is their budget again, not less: a
	// statement cut short leaves its outcome to be looked up.
	orderStatement time.Duration
	// demo:end
	// stateRecord: writing a state change to the outbox (events.go), on the
	// goroutine that changes the state, the drain's among them: a new
	// connection and a statement on a shared database 600 ms slow, with room,
	// so the draining event is kept while the database is slow; no more,
	// since the drain waits for it.
	stateRecord time.Duration
	// backgroundCall: one call of a background loop (a heartbeat, the outbox
	// poller's Redis calls, the backlog count): a hung dependency costs the loop
	// this, and a stop waits at most this for a call in flight. Not the
	// leader lock's: its calls take what the lock allows (leader.go).
	backgroundCall time.Duration
	// jobCall: one call of a job to Meilisearch or S3, a sixth of the job's
	// timeout and at most 10 s: a hung server costs an attempt, not the
	// worker for the whole KUMIKO_JOBS_TIMEOUT.
	jobCall time.Duration
	// jobsRescue: River runs a job again once it has been running this long
	// (RescueStuckJobsAfter, which River refuses below the job timeout): its
	// worker died, or the answer to River's fetch was lost while PostgreSQL
	// hung, and nobody works it. The job's timeout plus jobOutcomeWrite, so
	// a job cut off at its timeout is recorded rather than rescued. River's
	// rescuer looks every 30 s, so a stranded job runs again within
	// jobsRescue + 30 s (and River's 5 s scheduler round).
	jobsRescue time.Duration
	// optionalPhase: phases 11 and 12, an optional dependency at boot
	// (KUMIKO_OPTIONAL_DEPENDENCY_TIMEOUT): a hung Meilisearch or S3 costs the
	// boot this, then the phase warns and the boot goes on.
	optionalPhase time.Duration
	// readinessProbe: one run of one readiness check (KUMIKO_READINESS_PROBE_TIMEOUT).
	readinessProbe time.Duration
	// readinessStale: a check result older than two check intervals and a
	// probe means the check's last run hung past its own deadline; it then
	// counts as failed.
	readinessStale time.Duration
	// leaderRenewRetry: a renewal of the leader lock that failed is tried
	// again after a quarter of KUMIKO_LEADER_RENEW_INTERVAL, so one lost
	// reply costs a fraction of the margin the renew deadline keeps.
	leaderRenewRetry time.Duration
	// dbStatement and dbLock bound every statement on the server's side
	// (statement_timeout, lock_timeout), where no client deadline reaches; a
	// migration waits for the migration lock up to the phase timeout.
	dbStatement, dbLock time.Duration
	// dbIdleInTx: the server ends a session idle inside a transaction this
	// long (idle_in_transaction_session_timeout). A leader frozen between
	// raising the fence and committing its tick would otherwise hold the
	// fence row, and the next leader with it, until it woke.
	dbIdleInTx time.Duration
}

// abandonGrace is how long a function whose context has ended may take to
// return its own, more telling error before the lifecycle stops waiting for it.
const abandonGrace = 100 * time.Millisecond

// hardStopGrace is how long a background component's Stop waits for its
// goroutines after cancelling their context (startstop.go). It is shorter
// than abandonGrace so that, inside a shutdown hook, Stop's own error
// (naming what still runs) is the one that gets logged.
const hardStopGrace = abandonGrace / 2

// silentConnGrace: in the drain, an API connection that has not sent a
// whole request header this long after it was accepted is closed rather than
// waited for; at the connection cap it is closed to make room for a new one
// (capListener). Clients send their request as soon as their handshake is
// done; what stays silent is a browser's or a connection pool's unused
// preconnect, which net/http's Shutdown counts as busy for 5 s, or a
// slow-header attack. The price: a request whose header takes longer than
// this to arrive is cut when the drain or a newcomer at the cap reaches it.
const silentConnGrace = 500 * time.Millisecond

// stallFirstLook: a boot phase, drain step or release hook still running
// this long is looked at (its goroutines dumped, in memory), and again each
// time it has run twice as long, so one that then fails or overruns is
// explained by the stacks it was stuck in. Shorter than the shortest release
// bound (redisRelease, 1 s): a hook cut short by it has been looked at.
const stallFirstLook = 200 * time.Millisecond

// diagnosticsWrite bounds writing one incident's files (the recorder's
// window, some MiB, and a goroutine dump) on the drain's time.
const diagnosticsWrite = 2 * time.Second

// cancelGrace bounds a PostgreSQL cancel request; a hung server never takes it.
const cancelGrace = time.Second

// jobOutcomeWrite is how long River may take to record the outcome of a job
// that returned: one try of its completer (River's HotOperationTimeout).
const jobOutcomeWrite = 10 * time.Second

// wakeTimeout bounds one wake-up publish of the outbox poller: a Redis that
// hangs must not hold wake-ups back for longer than a hub's own poll would.
const wakeTimeout = time.Second

// silentConnPoll is how often the drain's in-flight wait looks for silent
// connections: each is closed at most this late.
const silentConnPoll = silentConnGrace / 4

// rejectPoll is how often the retry-after mode looks for the last request in flight.
const rejectPoll = 10 * time.Millisecond

// hookUnbounded is a shutdown hook's deadline when the drain has none (only
// tests run the hooks so): long enough never to cut one.
const hookUnbounded = time.Hour

// otlpDialTimeout bounds the boot's one connection to the OTLP endpoint
// (phase 2): an endpoint that does not answer within it is reported, and the
// boot goes on with the noop provider.
const otlpDialTimeout = 500 * time.Millisecond

// healthcheckTimeout bounds the healthcheck command's one request, as long
// as the Dockerfile's HEALTHCHECK --timeout.
const healthcheckTimeout = 3 * time.Second

// How often the loops run, how long their records live, and how their
// retries are paced.
const (
	// statusInterval is how often an instance rewrites its dashboard status
	// record besides on every state change and drain step (the rate of the
	// requests-per-second figure), and how long one write may take.
	statusInterval = time.Second
	// statusTTL drops the record of an instance that died without a drain.
	statusTTL = 5 * time.Second
	// stoppedTTL keeps a cleanly stopped instance on the page for a while.
	stoppedTTL = 30 * time.Second
	// clusterCacheTTL is how long one Redis read of the workers and the
	// leader answers every /api/instance request: a storm of dashboard polls
	// is then at most one SCAN per TTL, not one per request.
	clusterCacheTTL = time.Second

	// cronRecheck is the longest the scheduler sleeps without reading the
	// wall clock. Ticks are wall-clock instants, but a timer counts elapsed
	// time: after the wall clock steps (NTP, a resumed VM, an operator), a
	// timer set for the old distance fires late or early by the size of the
	// step. Waking at least this often and recomputing the wait bounds that
	// to this.
	cronRecheck = time.Second

	// A sequencer step that finds the delivery lock taken tries again after
	// sequencerRetryBase, doubling up to sequencerRetryMax (and for one poll
	// interval at most).
	sequencerRetryBase = time.Millisecond
	sequencerRetryMax  = 10 * time.Millisecond

	// The SSE hub reads again for an event a poller announced but it did not
	// find yet after catchUpRetryFirst, doubling up to catchUpRetryLast; then
	// the next tick finds it.
	catchUpRetryFirst = time.Millisecond
	catchUpRetryLast  = 128 * time.Millisecond

	// wakePerStream is the spacing of the SSE hub's wakes per open stream,
	// maxWakeGap the longest. A stream writes at most once per wake, so the
	// spacing bounds the fan-out's writes to 200,000 a second however fast
	// events come: events in between ride in the same write. 10,000 streams
	// are woken at most every 50 ms, 100 every 0.5 ms. A write measured
	// 10-20 µs of CPU at 10,000 streams on 2 cores, most of it in write(2):
	// past a few thousand streams, the writes a wake asks for take longer
	// than the gap, and streams write as often as they get through.
	wakePerStream = 5 * time.Microsecond
	maxWakeGap    = 100 * time.Millisecond
	// demo:begin (the orders demo's idempotency lease; scripts/new-service.sh --bare removes this block)

	// idempotencyLease is the TTL of an order's idempotency marker
	// (orders_idempotency.go): its request renews it, so a holder that dies
	// frees the key within it. Three renewals per lease: one lost or late
	// renewal does not lapse it.
	idempotencyLease      = 1500 * time.Millisecond
	idempotencyRenewEvery = idempotencyLease / 3
	// demo:end
)

func newTimeouts(c config) timeouts {
	l := c.Lifecycle
	releases := l.ShutdownTimeout - l.Linger - l.DrainTimeout // > 0: config validation says so
	return timeouts{
		boot:           l.StartupTimeout,
		phase:          l.PhaseTimeout,
		connect:        l.ConnectMaxWait,
		connectAttempt: min(5*time.Second, l.ConnectMaxWait),
		shutdown:       l.ShutdownTimeout,
		linger:         l.Linger,
		lingerMin:      min(l.Readiness.ProbePeriod, l.Linger),
		lingerQuiet:    cmp.Or(l.LingerQuiet, l.Readiness.ProbePeriod/2),
		drain:          l.DrainTimeout,
		sseSpread:      min(c.SSE.ReconnectSpread, l.DrainTimeout),
		sseSpreadStep:  c.SSE.ReconnectSpreadPerStream,
		hookReserve:    time.Second,
		jobsStop:       max(releases/2, abandonGrace),
		redisRelease:   time.Second,
		batchFinish:    2 * time.Second,
		poolClose:      2 * time.Second,
		request:        c.HTTP.DependencyTimeout,
		// demo:begin
		search:         c.HTTP.DependencyTimeout / 2,
		marker:         c.HTTP.DependencyTimeout / 4,
		commitMargin:   c.HTTP.DependencyTimeout / 5,
		orderStatement: c.HTTP.DependencyTimeout,
		// demo:end
		stateRecord:      3 * time.Second,
		backgroundCall:   time.Second,
		jobCall:          min(10*time.Second, c.Jobs.Timeout/6),
		jobsRescue:       c.Jobs.Timeout + jobOutcomeWrite,
		optionalPhase:    min(l.OptionalDependencyTimeout, l.PhaseTimeout),
		readinessProbe:   l.Readiness.ProbeTimeout,
		readinessStale:   2*l.Readiness.CheckInterval + l.Readiness.ProbeTimeout,
		leaderRenewRetry: c.LeaderElection.RenewInterval / 4,
		dbStatement:      c.DB.StatementTimeout,
		dbLock:           c.DB.LockTimeout,
		dbIdleInTx:       c.DB.IdleInTransactionTimeout,
	}
}
