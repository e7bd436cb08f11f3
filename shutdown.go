package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	rtrace "runtime/trace"
	"sync"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// This file follows a SIGTERM from the signal to the return value that main
// turns into the exit code: watchSignals → serve → shutdown → drain.

// stopRequest is why the process goes down.
type stopRequest struct {
	reason string
	failed bool // exit 1 even after a clean drain: a panic left the state unknown
}

// stopper records the first stop request and notices a second one.
type stopper struct {
	log       *logrus.Entry
	ctx       context.Context // ends with the first request: it aborts a boot in progress
	cancel    context.CancelCauseFunc
	requested chan struct{} // closed by the first request
	forced    chan struct{} // closed by a second SIGTERM/SIGINT: exit 1 at once

	mu    sync.Mutex
	first *stopRequest
	force sync.Once
}

func newStopper(log *logrus.Logger) *stopper {
	ctx, cancel := context.WithCancelCause(context.Background())
	return &stopper{log: log.WithField("component", "lifecycle"), ctx: ctx, cancel: cancel,
		requested: make(chan struct{}), forced: make(chan struct{})}
}

// request asks for a graceful shutdown. Only the first request counts, except
// that a later failed one still turns the exit code to 1.
func (s *stopper) request(r stopRequest) (first bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.first != nil {
		s.first.failed = s.first.failed || r.failed
		return false
	}
	s.first = &r
	s.log.WithFields(logrus.Fields{"event": "shutdown_requested", "reason": r.reason}).Info("lifecycle")
	s.cancel(fmt.Errorf("%w: %s", errShutdownRequest, r.reason))
	close(s.requested)
	return true
}

// forceExit gives up on the drain (Ctrl+C twice).
func (s *stopper) forceExit() { s.force.Do(func() { close(s.forced) }) }

func (s *stopper) why() stopRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.first == nil {
		return stopRequest{}
	}
	return *s.first
}

// watchSignals turns SIGTERM and SIGINT into a stop request, a second one into
// a forced exit (Ctrl+C twice), and ignores SIGHUP: there is no reload, a new
// process replaces this one. The end of ctx counts as a SIGTERM, which is how
// in-process tests stop the service. The returned func stops the watcher and
// waits for it.
func (a *app) watchSignals(ctx context.Context) (stop func()) {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	quit, done := make(chan struct{}), make(chan struct{})
	log := a.log.WithField("component", "lifecycle")
	go func() {
		defer close(done)
		ctxDone := ctx.Done()
		for {
			select {
			case sig := <-sigs:
				if sig == syscall.SIGHUP {
					log.WithField("signal", sig.String()).Info("ignoring SIGHUP: no reload, deploy a new process instead")
					continue
				}
				if !a.stop.request(stopRequest{reason: sig.String()}) {
					log.WithField("signal", sig.String()).Warn("second signal while draining: exiting at once")
					a.stop.forceExit()
				}
			case <-ctxDone:
				a.stop.request(stopRequest{reason: "context canceled"})
				ctxDone = nil
			case <-quit:
				return
			}
		}
	}()
	return func() {
		signal.Stop(sigs)
		close(quit)
		<-done
	}
}

// serve boots the process, serves until asked to stop, and drains. Its error
// is the exit code: nil is 0, anything else is 1.
//
// The process's goroutines carry the pprof labels of ctx (a test's marker
// in-process, none in production) under their own (diagnostics_labels.go).
func (a *app) serve(ctx context.Context) error {
	defer a.watchSignals(ctx)()

	bootErr := a.boot(withLabelsOf(a.stop.ctx, ctx))
	if bootErr == nil {
		<-a.stop.requested
	}
	return a.shutdown(withLabelsOf(context.Background(), ctx), bootErr)
}

// shutdown runs the drain within KUMIKO_SHUTDOWN_TIMEOUT. Past the budget, or
// on a second signal, it returns at once (exit 1) and leaves the drain behind:
// the process is about to exit, and the orchestrator would SIGKILL it anyway.
// Both leave diagnostics first, of where the drain was stuck. The exit line
// names the diagnostics' files and reasons; when the drain or the boot went
// wrong, a summary goes to the termination message. The flight recorder
// stops last. base carries only labels.
func (a *app) shutdown(base context.Context, bootErr error) error {
	start := time.Now()
	req := a.stop.why()
	switch {
	case bootErr != nil && req.reason != "":
		a.log.WithFields(logrus.Fields{"component": "lifecycle", "reason": req.reason}).Info("boot aborted by a stop request")
		bootErr = nil // asked to stop while starting: a clean exit, once released
	case bootErr != nil:
		req.reason = "boot failed"
	}

	budget := a.timeouts.shutdown
	ctx, cancel := context.WithTimeout(base, budget)
	defer cancel()

	drained := make(chan error, 1)
	go func() { drained <- a.drain(ctx, req.reason) }()
	var err error
	select {
	case err = <-drained:
	case <-ctx.Done():
		err = fmt.Errorf("shutdown did not finish within KUMIKO_SHUTDOWN_TIMEOUT=%s", budget)
		a.drainAbandoned(base, "budget", fmt.Sprintf("shutdown budget KUMIKO_SHUTDOWN_TIMEOUT=%s spent", budget))
	case <-a.stop.forced:
		err = errors.New("second signal: exited without finishing the drain")
		a.drainAbandoned(base, "signal", "second signal: drain abandoned")
	}

	if a.stop.why().failed {
		err = errors.Join(err, fmt.Errorf("stopped because of a failure: %s", a.stop.why().reason))
	}
	err = errors.Join(bootErr, err)
	code := 0
	if err != nil {
		code = 1
	}
	incidents := a.diag.recorded()
	if code != 0 || len(incidents) > 0 {
		a.leaveTerminationMessage(code, req.reason, err, incidents)
	}
	a.log.WithFields(logrus.Fields{"component": "lifecycle", "event": "exit", "code": code, "reason": req.reason,
		"duration_ms": time.Since(start).Milliseconds()}).WithFields(exitFields(incidents)).Info("lifecycle")
	a.diag.stop()
	return err
}

// drainAbandoned records where the drain was stuck when it was given up:
// the step its goroutines were in, and what they were blocked in.
func (a *app) drainAbandoned(ctx context.Context, name, reason string) {
	stacks := takeGoroutines()
	if where := stacks.blocked(labelStep, ""); where != "" {
		reason += ", still in step " + where
	}
	a.diag.record(ctx, name, reason, stacks)
}

// leaveTerminationMessage writes the paragraph Kubernetes shows as the
// container's last state (KUMIKO_TERMINATION_LOG), with every secret the
// config knows scrubbed from it.
func (a *app) leaveTerminationMessage(code int, stopReason string, err error, incidents []incident) {
	path := terminationLogPath(a.cfg.Diagnostics.TerminationLog)
	if path == "" {
		return
	}
	scrub := redactHook{secrets: append(a.cfg.secrets(), otlpSecrets(a.getenv)...)}
	msg := scrub.redact(terminationMessage(a.cfg.InstanceID, time.Now(), code, stopReason, err, incidents))
	if err := os.WriteFile(path, []byte(msg), 0o644); err != nil {
		componentDiagnostics.log(a.log).WithError(err).Warn("writing the termination message")
	}
}

// drain is the graceful shutdown. It reads as its timeline, one line a step.
// Every step logs msg=lifecycle step=<name> duration_ms=<int>, sets
// kumiko_shutdown_step_duration_seconds{step} and is a child span of
// lifecycle.shutdown; it lasts as long as what it waits for.
//
//	stop request ─┬─ readiness       state → draining: /health/ready answers 503, responses say Connection: close
//	              ├─ linger          serve on until the load balancer has stopped sending (at most KUMIKO_LINGER)
//	              ├─ closeListener   until the API port refuses new connections
//	              ├─ sseClose        ┐ KUMIKO_DRAIN_TIMEOUT: streams get `event: shutdown`, spread
//	              ├─ inFlight        ┘ out; requests finish; what is left then is force-closed
//	              ├─ hooks …         the release hooks, newest first: the boot read backwards
//	              │                  (readinessChecks, sseHub, leaderElection, jobsBacklog, jobsHeartbeat,
//	              │                  outboxPoller, jobsWorker, storage, search, heartbeats, clusterStatus,
//	              │                  redis, db; storage and search when configured)
//	              ├─ telemetryFlush  the spans of boot and drain leave the process
//	              │                  state → stopped
//	              └─ opsListener     probes and metrics answered until here
//	exit 0; 1 past KUMIKO_SHUTDOWN_TIMEOUT, on a second signal, or after a panic
//
// A boot that failed before phase 15 has no API listener: the drain starts
// at the release hooks then.
func (a *app) drain(ctx context.Context, reason string) error {
	ctx, task := rtrace.NewTask(ctx, "shutdown") // the flight recorder's trace groups the steps' regions under it
	defer task.End()
	ctx, span := a.lc.tracer().Start(ctx, "lifecycle.shutdown", trace.WithAttributes(attribute.String("reason", reason)))
	drainCtx, cancelDrain := context.WithTimeout(ctx, a.timeouts.drain) // sseClose and inFlight share it
	defer cancelDrain()

	a.step(ctx, "readiness", a.stopBeingReady)
	if a.api != nil {
		a.step(ctx, "linger", a.linger)
		a.step(ctx, "closeListener", a.closeAPIListener)
		a.step(ctx, "sseClose", func(ctx context.Context) error { return a.lc.closeStreams(drainCtx, ctx) })
		a.step(ctx, "inFlight", func(ctx context.Context) error { return a.awaitInFlight(ctx, drainCtx) })
	}
	releaseErr := a.lc.runShutdownHooks(ctx, a.timeouts.hookReserve, func(name string, took time.Duration, err error, stuck goroutineDump) {
		a.stepDone(ctx, name, time.Now().Add(-took), err)
		if err != nil {
			a.hookFailed(ctx, name, took, err, stuck)
		}
	})
	a.step(ctx, "telemetryFlush", a.flushTelemetry)
	a.lc.advanceTo(StateStopped)
	if a.ops != nil {
		a.step(ctx, "opsListener", a.closeOpsListener)
	}

	span.End()
	a.closeTelemetry(ctx) // sends the spans of the last two steps and of the drain itself
	return releaseErr
}

// stopBeingReady: readiness answers 503 from this instant, the state says so
// and no dependency probe is needed. From the same instant every API response
// carries Connection: close (closeAfterDraining), so no client keeps reusing
// this instance.
func (a *app) stopBeingReady(context.Context) error {
	a.lc.advanceTo(StateDraining)
	return nil
}

// linger serves on, normally, until the load balancer has visibly stopped
// sending: no new connection and no request other than a health check for
// lingerQuiet, and not before lingerMin, the time a balancer takes to see
// the 503 (KUMIKO_READINESS_PROBE_PERIOD). KUMIKO_LINGER bounds it. With no
// traffic at all it lasts lingerMin; behind a balancer that keeps sending,
// KUMIKO_LINGER. One line says which ended it.
//
// The quiet counts from the stop request only: a lull before it says nothing
// about whether the balancer has seen the 503. It also keeps lingerQuiet =
// KUMIKO_LINGER a fixed linger on an instance that was never sent anything.
func (a *app) linger(ctx context.Context) error {
	t, start := a.timeouts, time.Now()
	ended := "max"
	for {
		elapsed := time.Since(start)
		quiet := min(a.api.traffic.quietFor(), elapsed)
		if elapsed >= t.linger {
			break
		}
		if elapsed >= t.lingerMin && quiet >= t.lingerQuiet {
			ended = "quiet"
			break
		}
		// Look again when both could first be true, or at the bound.
		wait := max(t.lingerMin-elapsed, t.lingerQuiet-quiet)
		if err := sleepCtx(ctx, min(wait, t.linger-elapsed)); err != nil {
			return err
		}
	}
	a.log.WithFields(logrus.Fields{"component": "lifecycle", "event": "linger_ended", "ended": ended,
		"duration_ms": time.Since(start).Milliseconds(), "quiet_ms": t.lingerQuiet.Milliseconds()}).Info("lifecycle")
	a.status.lingerDone(ended) // the dashboard shows it next to the step
	return nil
}

// closeAfterDraining closes each API connection after its next response once
// the drain has begun. http.Server.SetKeepAlivesEnabled(false) would also close
// the idle connections at once, under a load balancer that has not yet seen
// the 503 and may be sending a request on one of them that very moment:
// HAProxy then drops its client's connection without an answer (a POST is not
// retried). A connection that answers first is closed cleanly; the idle ones
// are closed by closeListener, after the linger, when no traffic comes.
func closeAfterDraining(lc *Lifecycle, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if lc.State() >= StateDraining {
			w.Header().Set("Connection", "close")
		}
		h.ServeHTTP(w, r)
	})
}

// closeAPIListener refuses new connections and closes the idle ones. It is
// http.Server.Shutdown's first pass, asked with a context that has already
// ended: Shutdown closes the listener (and returns only once Serve has let go
// of it), closes the idle connections, and returns instead of waiting for the
// handlers. awaitInFlight waits for them, after the streams are closed.
//
// With KUMIKO_DRAIN_REJECT=retry-after the port stays open instead: new
// requests are answered 503 with Retry-After (admitWhenServing) until
// awaitInFlight has seen the requests in flight finish.
func (a *app) closeAPIListener(context.Context) error {
	if a.cfg.Lifecycle.DrainReject == drainRejectRetryAfter {
		a.rejecting.Store(true)
		return nil
	}
	firstPassOnly, cancel := context.WithCancel(context.Background())
	cancel()
	if err := a.api.srv.Shutdown(firstPassOnly); err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("closing the API listener: %w", err)
	}
	return nil
}

// awaitInFlight waits for the requests in flight until the drain budget ends,
// then force-closes what is left, with a warning and a metric. Shutdown may
// also time out on the connections of streams closeStreams has just
// force-closed: those are no requests, so no warning for them.
//
// Shutdown is asked here, after closeStreams, not once from closeListener:
// it polls for the last handlers with a back-off that doubles up to 500 ms,
// and a poll started before the streams closed would find them gone up to
// half a second late. While it waits, connections that have sent nothing
// for silentConnGrace are closed (Shutdown itself would wait 5 s for them).
func (a *app) awaitInFlight(ctx, drainCtx context.Context) error {
	if a.rejecting.Load() {
		// The port answers 503s until the requests in flight are done.
		for a.inFlight.Load() > 0 {
			if sleepCtx(drainCtx, rejectPoll) != nil {
				break // the drain budget is spent: Shutdown force-closes below
			}
		}
	}
	shutdown := make(chan error, 1)
	go func() { shutdown <- a.api.srv.Shutdown(drainCtx) }()
	silent := a.api.silent.closeSilent(silentConnGrace)
	tick := time.NewTicker(silentConnPoll)
	defer tick.Stop()
	var err error
	for waiting := true; waiting; {
		select {
		case err = <-shutdown:
			waiting = false
		case <-tick.C:
			silent += a.api.silent.closeSilent(silentConnGrace)
		}
	}
	if silent > 0 {
		a.log.WithFields(logrus.Fields{"component": "lifecycle", "step": "inFlight", "connections": silent,
			"silent_ms": silentConnGrace.Milliseconds()}).Info("closed connections that sent no request")
	}
	if err != nil {
		if n := a.inFlight.Load(); n > 0 {
			a.metrics.shutdownForced.Add(float64(n))
			a.log.WithFields(logrus.Fields{"component": "lifecycle", "step": "inFlight", "requests": n,
				"drain_timeout_ms": a.timeouts.drain.Milliseconds()}).Warn("drain timeout: force-closing requests still in flight")
			// Before the close: the dump shows the requests where they are stuck.
			a.requestsForceClosed(ctx, n)
		}
		a.api.srv.Close()
	}
	<-a.api.done
	return nil
}

// drainRejectRetryAfter is KUMIKO_DRAIN_REJECT's mode that keeps the port open.
const drainRejectRetryAfter = "retry-after"

// flushTelemetry sends the spans recorded so far; the exporter stays open
// for the spans of the steps still to come.
func (a *app) flushTelemetry(ctx context.Context) error {
	if a.tracing.flush == nil {
		return nil
	}
	return a.tracing.flush(ctx)
}

// closeOpsListener closes the ops port last: probes and metrics answered until here.
func (a *app) closeOpsListener(context.Context) error {
	err := a.ops.srv.Close()
	<-a.ops.done
	return err
}

// closeTelemetry shuts the exporter down, which sends what it still holds.
// It is no step of its own: its span could never be sent.
func (a *app) closeTelemetry(ctx context.Context) {
	if a.tracing.shutdown == nil {
		return
	}
	if err := a.tracing.shutdown(ctx); err != nil {
		a.log.WithField("component", "lifecycle").WithError(err).Warn("closing the trace exporter")
	}
}

// requestsForceClosed records the requests the drain is about to cut: their
// routes, and where the first is blocked.
func (a *app) requestsForceClosed(ctx context.Context, n int64) {
	stacks := takeGoroutines()
	reason := fmt.Sprintf("inFlight: %s force-closed at KUMIKO_DRAIN_TIMEOUT=%s", count(n, "request"), a.timeouts.drain)
	if where := stacks.blocked(labelRoute, ""); where != "" {
		reason += ", " + where
	}
	a.diag.record(ctx, "inFlight", reason, stacks)
}

// hookFailed records a release hook that failed or overran its share, with
// the stacks it was stuck in while it still ran: the hook's own, and those of
// the component it stops (a hook is named after its component), which a
// Stop waits for.
func (a *app) hookFailed(ctx context.Context, name string, took time.Duration, err error, stuck goroutineDump) {
	reason := fmt.Sprintf("%s: release hook failed after %s: %v", name, took.Round(time.Millisecond), cmp.Or(errors.Unwrap(err), err))
	if where := stuck.blocked(labelStep, name); where != "" {
		reason += ", " + where
	}
	if where := stuck.blocked(labelComponent, name); where != "" {
		reason += ", its component " + where
	}
	a.diag.record(ctx, name, reason, stuck)
}

// step runs one drain step, labelled with its name, and logs it.
func (a *app) step(ctx context.Context, name string, fn func(context.Context) error) {
	start := time.Now()
	var err error
	labelled(ctx, labelStep, name, func() { err = fn(ctx) })
	a.stepDone(ctx, name, start, err)
}

func (a *app) stepDone(ctx context.Context, name string, start time.Time, err error) {
	took := time.Since(start)
	a.metrics.shutdownStep.WithLabelValues(name).Set(took.Seconds())
	a.status.stepDone(name, took, err) // the dashboard shows the drain step by step
	_, span := a.lc.tracer().Start(ctx, "lifecycle.shutdown."+name, trace.WithTimestamp(start))
	entry := a.log.WithFields(logrus.Fields{"component": "lifecycle", "step": name, "duration_ms": took.Milliseconds()})
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
		entry.WithError(err).Warn("lifecycle")
	} else {
		entry.Info("lifecycle")
	}
	span.End()
}

// sleepCtx sleeps for d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}
