package main

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// State is where the process is in its life. It only ever moves forward:
// starting → ready → draining → stopped (a step may be skipped, never undone).
type State int32

const (
	StateStarting State = iota
	StateReady
	StateDraining
	StateStopped
)

var stateNames = [...]string{"starting", "ready", "draining", "stopped"}

func (s State) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("State(%d)", int32(s))
}

// Lifecycle owns the process state, the boot timeline and the shutdown hooks.
// Only the framework uses it (boot.go, shutdown.go and the background components);
// feature code never needs to ask which state the process is in.
type Lifecycle struct {
	log     *logrus.Entry
	metrics *metrics
	born    time.Time

	mu        sync.Mutex
	state     State
	phase     string // the startup phase running now
	timeline  []phaseRecord
	listeners []stateListener
	nextID    int
	hooks     []shutdownHook
	// streamClosers end the long-lived responses in drain step sseClose.
	streamClosers []func(drain, ctx context.Context) error

	// Phase spans are made from the timeline when a phase ends, so the phases
	// that ran before phase 2 set up tracing are replayed into it then.
	trace    trace.Tracer
	bootCtx  context.Context // carries the lifecycle.startup span
	bootSpan trace.Span
}

type stateListener struct {
	id int
	fn func(from, to State)
}

func newLifecycle(log *logrus.Logger, m *metrics, born time.Time) *Lifecycle {
	lc := &Lifecycle{log: log.WithField("component", "lifecycle"), metrics: m, born: born,
		trace: noop.NewTracerProvider().Tracer(serviceName)}
	m.setState(StateStarting)
	return lc
}

// State is the current lifecycle state.
func (lc *Lifecycle) State() State {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	return lc.state
}

// Uptime is the time since the process was born (not since it became ready).
func (lc *Lifecycle) Uptime() time.Duration { return time.Since(lc.born) }

// OnStateChange calls fn after every transition, in registration order, on the
// goroutine that made the transition: the process's one way to react to a
// state change. An observer that panics is logged and counted
// (kumiko_panics_total{component="stateObserver"}), and the transition goes
// on: a broken observer must not stop a drain. The returned func unregisters fn.
func (lc *Lifecycle) OnStateChange(fn func(from, to State)) (unregister func()) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	lc.nextID++
	id := lc.nextID
	lc.listeners = append(lc.listeners, stateListener{id: id, fn: fn})
	return func() {
		lc.mu.Lock()
		defer lc.mu.Unlock()
		for i, l := range lc.listeners {
			if l.id == id {
				lc.listeners = append(lc.listeners[:i:i], lc.listeners[i+1:]...)
				return
			}
		}
	}
}

// moveTo makes a forward transition. A backward (or same-state) transition is a
// programming error: it panics so that tests catch it rather than letting the
// process silently report "ready" again after it began to drain.
func (lc *Lifecycle) moveTo(to State) {
	lc.mu.Lock()
	from := lc.state
	if to <= from {
		lc.mu.Unlock()
		panic(fmt.Sprintf("lifecycle: illegal state transition %s → %s", from, to))
	}
	lc.state = to
	if to != StateStarting {
		lc.phase = ""
	}
	listeners := append([]stateListener(nil), lc.listeners...)
	lc.mu.Unlock()

	lc.log.WithFields(logrus.Fields{"event": "state_changed", "from": from.String(), "to": to.String()}).Info("lifecycle")
	if from == StateStarting {
		lc.endBootSpan(to)
	}
	lc.metrics.stateChanged(from, to)
	for _, l := range listeners {
		lc.notify(l, from, to)
	}
}

func (lc *Lifecycle) notify(l stateListener, from, to State) {
	defer func() {
		if r := recover(); r != nil {
			lc.metrics.panics.WithLabelValues(componentStateObserver.String()).Inc()
			lc.log.WithFields(logrus.Fields{"component": componentStateObserver.String(), "panic": fmt.Sprint(r),
				"stack": string(debug.Stack()), "from": from.String(), "to": to.String()}).Error("state-change observer panicked")
		}
	}()
	l.fn(from, to)
}

// advanceTo moves to the state unless the process is already there or beyond it.
// Shutdown uses it: draining may be entered from starting or from ready.
func (lc *Lifecycle) advanceTo(to State) {
	if lc.State() < to {
		lc.moveTo(to)
	}
}

// ---------------------------------------------------------------------------
// Startup phases

// onFail is what a failed phase does to the boot.
type onFail int

const (
	failExit onFail = iota // the process cannot serve without it: the boot ends, exit 1
	failWarn               // degrade and go on: the phase is logged with outcome=warn
)

type phaseOutcome string

const (
	outcomeOK      phaseOutcome = "ok"
	outcomeWarn    phaseOutcome = "warn"
	outcomeSkipped phaseOutcome = "skipped"
	outcomeFailed  phaseOutcome = "failed"
)

// phaseRecord is one line of the boot timeline (GET /admin/lifecycle).
type phaseRecord struct {
	Phase      string       `json:"phase"`
	StartedAt  time.Time    `json:"startedAt"`
	DurationMs int64        `json:"durationMs"`
	Outcome    phaseOutcome `json:"outcome"`
	Retries    int          `json:"retries"`
	Note       string       `json:"note,omitempty"`
	took       time.Duration
}

// phaseRun is what a running phase can report besides its error.
type phaseRun struct {
	name    string
	retries int
	note    string
	warned  bool
}

// warn marks a phase that succeeded in a degraded way (e.g. pending migrations
// in warn-on-pending mode).
func (p *phaseRun) warn(note string) { p.warned, p.note = true, note }

// skipped is returned by a phase whose component is not configured. The boot
// log still shows the phase, with outcome=skipped and the reason.
type skipped struct{ reason string }

func (s skipped) Error() string { return "skipped: " + s.reason }

func skipPhase(reason string) error { return skipped{reason: reason} }

var (
	errPhaseTimeout    = errors.New("phase timeout")
	errStartupBudget   = errors.New("startup budget exhausted")
	errShutdownRequest = errors.New("shutdown requested")
)

// runPhase runs one startup phase with its own timeout and logs one line at its end:
// msg=lifecycle phase=<name> duration_ms=<int> outcome=<ok|warn|skipped|failed> retries=<int>.
// It returns an error only when the boot must end.
func (lc *Lifecycle) runPhase(ctx context.Context, name string, timeout time.Duration, policy onFail, fn func(context.Context, *phaseRun) error) error {
	lc.mu.Lock()
	lc.phase = name
	lc.mu.Unlock()

	start := time.Now()
	pctx, cancel := context.WithTimeoutCause(ctx, timeout, fmt.Errorf("%w: %s did not finish within %s", errPhaseTimeout, name, timeout))
	defer cancel()
	p := &phaseRun{name: name}
	err := runBounded(pctx, func() error { return fn(pctx, p) })
	if err != nil && pctx.Err() != nil {
		// Report why the phase's context ended (its timeout, the boot budget or a
		// shutdown request) rather than the bare "context deadline exceeded".
		err = fmt.Errorf("%w (%v)", context.Cause(pctx), err)
	}

	outcome := outcomeOK
	var skip skipped
	switch {
	case errors.As(err, &skip):
		outcome, p.note, err = outcomeSkipped, skip.reason, nil
	case err != nil && policy == failWarn && ctx.Err() == nil:
		outcome, p.note, err = outcomeWarn, err.Error(), nil
	case err != nil:
		outcome = outcomeFailed
	case p.warned:
		outcome = outcomeWarn
	}
	took := time.Since(start)
	rec := phaseRecord{Phase: name, StartedAt: start, DurationMs: took.Milliseconds(),
		Outcome: outcome, Retries: p.retries, Note: p.note, took: took}
	lc.record(rec, err)
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// runBounded returns fn's result, or the context's error soon after ctx ends
// even if fn ignores ctx: a phase that overruns its timeout must not hang the
// boot. A function that honours ctx gets a moment to return its own, more
// telling error ("gave up after 5 attempts: last error: …"). An abandoned fn
// keeps running until it returns; the process is about to exit then.
func runBounded(ctx context.Context, fn func() error) error {
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	select {
	case err := <-done:
		if err == nil {
			err = ctx.Err()
		}
		return err
	case <-time.After(abandonGrace):
		return ctx.Err()
	}
}

// bestEffortError is the failure of a cleanup whose leftovers expire by
// themselves (a heartbeat key, the leader lock, the dashboard record), or
// whose work the next owner takes up (an outbox batch rolled back): its step
// is logged as failed, but it does not turn the exit code to 1 — nothing
// was lost.
type bestEffortError struct{ err error }

func (e *bestEffortError) Error() string { return "best-effort cleanup failed: " + e.err.Error() }
func (e *bestEffortError) Unwrap() error { return e.err }

// bestEffort makes fn's failure a bestEffortError.
func bestEffort(fn func(context.Context) error) func(context.Context) error {
	return func(ctx context.Context) error {
		if err := fn(ctx); err != nil {
			return &bestEffortError{err: err}
		}
		return nil
	}
}

// within bounds a release hook to d on its own, whatever its slice of the
// shutdown budget: a hung dependency costs the drain d, not the budget.
func within(d time.Duration, fn func(context.Context) error) func(context.Context) error {
	return func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, d)
		defer cancel()
		return fn(ctx)
	}
}

func (lc *Lifecycle) record(rec phaseRecord, err error) {
	lc.mu.Lock()
	lc.timeline = append(lc.timeline, rec)
	lc.phaseSpan(rec, err)
	lc.mu.Unlock()

	fields := logrus.Fields{"phase": rec.Phase, "duration_ms": rec.DurationMs, "outcome": string(rec.Outcome), "retries": rec.Retries}
	if rec.Note != "" {
		fields["note"] = rec.Note
	}
	entry := lc.log.WithFields(fields)
	switch rec.Outcome {
	case outcomeFailed:
		entry.WithError(err).Error("lifecycle")
	case outcomeWarn:
		entry.Warn("lifecycle")
	default:
		entry.Info("lifecycle")
	}
	lc.metrics.phaseDone(rec)
}

// slowestPhase is the phase that took longest so far: "boot took 4.2s, of
// which 3.1s dbConnect" is the first thing an operator wants to know.
func (lc *Lifecycle) slowestPhase() phaseRecord {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	var slowest phaseRecord
	for _, r := range lc.timeline {
		if r.DurationMs >= slowest.DurationMs {
			slowest = r
		}
	}
	return slowest
}

// traceWith switches to a real tracer (phase 2): it opens the lifecycle.startup
// span at process birth and replays the phases that already ran into it.
func (lc *Lifecycle) traceWith(t trace.Tracer) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	lc.trace = t
	lc.bootCtx, lc.bootSpan = t.Start(context.Background(), "lifecycle.startup", trace.WithTimestamp(lc.born))
	for _, rec := range lc.timeline {
		lc.phaseSpan(rec, nil)
	}
}

func (lc *Lifecycle) tracer() trace.Tracer {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	return lc.trace
}

// phaseSpan emits lifecycle.startup.<phase> with the phase's real timestamps.
// Called with lc.mu held.
func (lc *Lifecycle) phaseSpan(rec phaseRecord, err error) {
	if lc.bootSpan == nil {
		return
	}
	_, span := lc.trace.Start(lc.bootCtx, "lifecycle.startup."+rec.Phase, trace.WithTimestamp(rec.StartedAt),
		trace.WithAttributes(attribute.String("outcome", string(rec.Outcome)), attribute.Int("retries", rec.Retries)))
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End(trace.WithTimestamp(rec.StartedAt.Add(rec.took)))
}

func (lc *Lifecycle) endBootSpan(to State) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	if lc.bootSpan == nil {
		return
	}
	if to != StateReady {
		lc.bootSpan.SetStatus(codes.Error, "boot did not reach ready")
	}
	lc.bootSpan.End()
	lc.bootSpan = nil
}

// Phase is the startup phase running now ("" once the boot is over).
func (lc *Lifecycle) Phase() string {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	return lc.phase
}

// Timeline is a copy of the boot timeline so far.
func (lc *Lifecycle) Timeline() []phaseRecord {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	return append([]phaseRecord(nil), lc.timeline...)
}

// ---------------------------------------------------------------------------
// Streams

// OnCloseStreams registers fn for drain step sseClose, which comes after the
// listener closes and before the requests in flight are awaited: a
// long-lived response (an event stream) is not a request in flight, and
// http.Server.Shutdown never ends one by itself, so without this step the
// drain would always run into its timeout. fn gets drain, the budget its
// goodbyes share with the requests in flight, and ctx, the shutdown's, for
// what it must force-close and wait for.
func (lc *Lifecycle) OnCloseStreams(fn func(drain, ctx context.Context) error) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	lc.streamClosers = append(lc.streamClosers, fn)
}

// closeStreams runs every registered stream closer, in order, and joins their errors.
func (lc *Lifecycle) closeStreams(drain, ctx context.Context) error {
	lc.mu.Lock()
	closers := slices.Clone(lc.streamClosers)
	lc.mu.Unlock()
	var errs []error
	for _, fn := range closers {
		errs = append(errs, fn(drain, ctx))
	}
	return errors.Join(errs...)
}

// ---------------------------------------------------------------------------
// Shutdown hooks

type shutdownHook struct {
	name string // the component's: the drain step and kumiko_shutdown_step_duration_seconds{step}
	fn   func(context.Context) error
}

// RegisterShutdownHook registers the release of component c, just acquired.
// Hooks run last-registered-first, so teardown is the boot in reverse by
// construction.
func (lc *Lifecycle) RegisterShutdownHook(c component, fn func(context.Context) error) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	lc.hooks = append(lc.hooks, shutdownHook{name: c.String(), fn: fn})
}

// runShutdownHooks runs every registered hook, LIFO, each bounded by its slice of
// ctx's deadline. A hook that fails or overruns its slice is logged and the next
// one runs anyway: the DB pool must still close when the jobs worker hangs. The
// error joins every failure. Each hook runs at most once, even if this is called
// again. A hook runs labelled step=<its name> and is watched while it runs:
// step gets the last look at the goroutines it took (watchGoroutines).
func (lc *Lifecycle) runShutdownHooks(ctx context.Context, reserve time.Duration, step func(name string, d time.Duration, err error, stuck goroutineDump)) error {
	var errs []error
	for {
		lc.mu.Lock()
		n := len(lc.hooks)
		if n == 0 {
			lc.mu.Unlock()
			return errors.Join(errs...)
		}
		hook := lc.hooks[n-1]
		lc.hooks = lc.hooks[:n-1]
		lc.mu.Unlock()

		hctx, cancel := context.WithDeadline(ctx, hookDeadline(ctx, reserve, n-1))
		start := time.Now()
		stopWatch := watchGoroutines(ctx)
		err := runBounded(hctx, func() (err error) {
			labelled(hctx, labelStep, hook.name, func() { err = hook.fn(hctx) })
			return err
		})
		stuck := stopWatch()
		cancel()
		if err != nil {
			err = fmt.Errorf("shutdown hook %s: %w", hook.name, err)
			if !errors.As(err, new(*bestEffortError)) {
				errs = append(errs, err)
			}
		}
		step(hook.name, time.Since(start), err, stuck)
	}
}

// hookDeadline gives a hook what is left of the budget minus a reserve for each
// hook still waiting after it, so one hung hook cannot eat the time the DB pool
// needs to close. The reserve per hook is less when the budget is small.
func hookDeadline(ctx context.Context, reserve time.Duration, hooksAfter int) time.Time {
	deadline, ok := ctx.Deadline()
	if !ok {
		return time.Now().Add(hookUnbounded)
	}
	remaining := time.Until(deadline)
	reserve = min(reserve, remaining/time.Duration(2*(hooksAfter+1)))
	return deadline.Add(-reserve * time.Duration(hooksAfter))
}
