package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
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
func (a *app) serve(ctx context.Context) error {
	defer a.watchSignals(ctx)()

	bootErr := a.boot(a.stop.ctx)
	if bootErr == nil {
		<-a.stop.requested
	}
	return a.shutdown(bootErr)
}

// shutdown runs the drain within KUMIKO_SHUTDOWN_TIMEOUT. Past the budget, or
// on a second signal, it returns at once (exit 1) and leaves the drain behind:
// the process is about to exit, and the orchestrator would SIGKILL it anyway.
func (a *app) shutdown(bootErr error) error {
	start := time.Now()
	req := a.stop.why()
	switch {
	case bootErr != nil && req.reason != "":
		a.log.WithFields(logrus.Fields{"component": "lifecycle", "reason": req.reason}).Info("boot aborted by a stop request")
		bootErr = nil // asked to stop while starting: a clean exit, once released
	case bootErr != nil:
		req.reason = "boot failed"
	}

	budget := a.cfg.Lifecycle.ShutdownTimeout
	if budget == 0 {
		budget = defaultConfig().Lifecycle.ShutdownTimeout // the config never loaded
	}
	ctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()

	drained := make(chan error, 1)
	go func() { drained <- a.drain(ctx, req.reason) }()
	var err error
	select {
	case err = <-drained:
	case <-ctx.Done():
		err = fmt.Errorf("shutdown did not finish within KUMIKO_SHUTDOWN_TIMEOUT=%s", budget)
	case <-a.stop.forced:
		err = errors.New("second signal: exited without finishing the drain")
	}

	if a.stop.why().failed {
		err = errors.Join(err, fmt.Errorf("stopped because of a failure: %s", a.stop.why().reason))
	}
	err = errors.Join(bootErr, err)
	code := 0
	if err != nil {
		code = 1
	}
	a.log.WithFields(logrus.Fields{"component": "lifecycle", "event": "exit", "code": code, "reason": req.reason,
		"duration_ms": time.Since(start).Milliseconds()}).Info("lifecycle")
	return err
}

// drain is the graceful shutdown, step by step. Every step logs
// msg=lifecycle step=<name> duration_ms=<int> and is a child span of
// lifecycle.shutdown.
func (a *app) drain(ctx context.Context, reason string) error {
	ctx, span := a.lc.tracer().Start(ctx, "lifecycle.shutdown", trace.WithAttributes(attribute.String("reason", reason)))
	var errs []error

	// 1. Readiness answers 503 from this instant: the state says so, no
	//    dependency probe is needed. Keep-alives go off first, so from the
	//    same instant every response carries Connection: close and no client
	//    keeps reusing this instance.
	a.step(ctx, "readiness", func(context.Context) error {
		if a.api != nil {
			a.api.srv.SetKeepAlivesEnabled(false)
		}
		a.lc.advanceTo(StateDraining)
		return nil
	})

	if a.api != nil {
		// 2. Linger: keep serving while the load balancer notices the 503 and
		//    moves traffic.
		a.step(ctx, "linger", func(ctx context.Context) error { return sleepCtx(ctx, a.cfg.Lifecycle.Linger) })

		// 3. Close the API listener: new connections are refused from here on.
		//    http.Server.Shutdown closes it at once, then waits for the handlers
		//    in flight; step 5 collects that wait.
		drainCtx, cancelDrain := context.WithTimeout(ctx, a.cfg.Lifecycle.DrainTimeout)
		defer cancelDrain()
		idle := make(chan error, 1)
		a.step(ctx, "closeListener", func(ctx context.Context) error {
			go func() { idle <- a.api.srv.Shutdown(drainCtx) }()
			select { // the step ends when the port refuses, not when Shutdown was asked
			case <-a.api.closed:
				return nil
			case <-ctx.Done():
				return context.Cause(ctx)
			}
		})

		// 4. End the event streams with `event: shutdown` and a retry hint.
		//    http.Server.Shutdown never ends a streaming response by itself,
		//    and streams are not in-flight requests: the drain would otherwise
		//    always run into its timeout. This step runs on the drain budget: a
		//    client that stopped reading cannot take its goodbye, so what is
		//    left when the budget ends is force-closed (its write deadline
		//    pulled to now), and the release hooks below keep their share.
		//    Steps 4 and 5 share the one drain budget, drainCtx.
		a.step(ctx, "sseClose", func(ctx context.Context) error {
			asked, forced, err := a.sse.closeStreams(drainCtx, ctx)
			// streams_open is kumiko_sse_streams now: 0 unless a handler outlived its force-close.
			entry := a.log.WithFields(logrus.Fields{"component": "sse", "streams": asked, "forced": forced, "streams_open": a.sse.openStreams()})
			if forced > 0 {
				entry.WithField("drain_timeout_ms", a.cfg.Lifecycle.DrainTimeout.Milliseconds()).Warn("drain timeout: force-closed event streams that did not end")
			} else {
				entry.Info("event streams closed")
			}
			return err
		})

		// 5. Wait for in-flight requests up to KUMIKO_DRAIN_TIMEOUT, then
		//    force-close what is left, with a warning and a metric. Shutdown
		//    may also time out on the connections of streams step 4 has just
		//    force-closed: those are no requests, so no warning for them.
		a.step(ctx, "inFlight", func(context.Context) error {
			if err := <-idle; err != nil {
				if n := a.inFlight.Load(); n > 0 {
					a.metrics.shutdownForced.Add(float64(n))
					a.log.WithFields(logrus.Fields{"component": "lifecycle", "step": "inFlight", "requests": n,
						"drain_timeout_ms": a.cfg.Lifecycle.DrainTimeout.Milliseconds()}).Warn("drain timeout: force-closing requests still in flight")
				}
				a.api.srv.Close()
			}
			<-a.api.done
			return nil
		})
	}

	// 6–7. Release everything the boot acquired, newest first: the workers,
	//      then heartbeats, storage, search, Redis and the DB pool. Each is a
	//      shutdown hook registered right after its acquisition.
	if err := a.lc.runShutdownHooks(ctx, func(name string, took time.Duration, err error) {
		a.stepDone(ctx, name, time.Now().Add(-took), err)
	}); err != nil {
		errs = append(errs, err)
	}

	// 8. State → stopped, then flush the traces of boot and drain.
	a.lc.advanceTo(StateStopped)
	span.End()
	a.step(ctx, "telemetryFlush", func(ctx context.Context) error { return a.flushTelemetry(ctx) })

	// 9. Close the ops listener last: probes and metrics answered until here.
	if a.ops != nil {
		a.step(ctx, "opsListener", func(context.Context) error {
			err := a.ops.srv.Close()
			<-a.ops.done
			return err
		})
	}
	return errors.Join(errs...)
}

// step runs one drain step and logs it.
func (a *app) step(ctx context.Context, name string, fn func(context.Context) error) {
	start := time.Now()
	a.stepDone(ctx, name, start, fn(ctx))
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

func (a *app) flushTelemetry(ctx context.Context) error {
	if a.tracing.shutdown == nil {
		return nil
	}
	return a.tracing.shutdown(ctx)
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
