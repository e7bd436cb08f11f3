package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// startStop is the one start/stop shape of every background component (the
// outbox poller, the leader elector, the SSE hub, a heartbeat loop), after
// River's rivershared/startstop. A component embeds it, implements Start as
// a call to start, and gets Stop from it. The contract:
//
//   - Start runs the component's synchronous checks (prepare) and returns their
//     error, then starts its run goroutine. A Start while it runs is a no-op.
//   - Every goroutine the component owns is started through start or goOwned:
//     a panic in one is recovered here, once, and handed to onPanic (the app
//     logs it with its stack, counts it and starts a graceful shutdown that
//     ends in exit 1); Stop waits for all of them.
//   - Stop is idempotent and may come before Start. It stops the component
//     in one or two stages (stopMode) and returns once every owned goroutine
//     has returned. When Stop's ctx ends first, it stops hard: the goroutines'
//     context is cancelled (cause: ctx's cause) and Stop waits hardStopGrace
//     more, then returns an error wrapping ctx's cause.
//   - A goroutine that ignores even the hard stop is not forgotten: Stop's
//     error then also wraps errStillRunning, the component stays "stopping",
//     a later Stop waits for it again and Start refuses until it has returned.
//     During a shutdown nothing more is waited for: the process exits soon.
type startStop struct {
	component component
	mode      stopMode
	onPanic   func(c component, recovered any)

	mu       sync.Mutex
	started  bool                    // from a successful Start until a Stop has seen every goroutine return
	stopCh   chan struct{}           // closed when Stop begins: the soft stop
	cancel   context.CancelCauseFunc // cancels the goroutines' context: the hard stop
	active   int                     // owned goroutines still running
	finished chan struct{}           // closed when active drops to 0
}

// stopMode says what a component has to finish when it is stopped.
type stopMode int

const (
	// stopNow: nothing in flight needs finishing, so Stop cancels the
	// goroutines' context at once (the SSE hub, a heartbeat loop).
	stopNow stopMode = iota
	// stopSoft: Stop first closes stopping() so the component finishes what it
	// holds and takes nothing new (the poller's batch, the elector's lock
	// release); their context is cancelled only when Stop's ctx ends.
	stopSoft
)

// errStopped is the cause of the goroutines' context after a stop that did
// not have to be hard.
var errStopped = errors.New("component stopped")

// errStoppedHard is wrapped in Stop's error when ctx ended before the
// component finished by itself and the hard stop (cancelling its work) ended
// it: its goroutines are gone, its work in hand was cut short.
var errStoppedHard = errors.New("stopped hard")

// errStillRunning is wrapped in Stop's error when a goroutine outlived the
// hard stop and hardStopGrace.
var errStillRunning = errors.New("goroutines still running after the hard stop")

func newStartStop(c component, mode stopMode, onPanic func(c component, recovered any)) *startStop {
	return &startStop{component: c, mode: mode, onPanic: onPanic}
}

// start is the body of a component's Start: prepare (may be nil) runs with
// ctx and its error is returned as is, then run starts in an owned goroutine.
// prepare runs under the lock that serializes Start and Stop, so it must not
// call back into s.
// run's context is detached from ctx — a boot phase's context ends with the
// phase — and ends with the hard stop (or at once with stopNow).
func (s *startStop) start(ctx context.Context, prepare func(context.Context) error, run func(context.Context)) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.started && !s.stopBegun():
		return nil
	case s.started && s.active > 0:
		return fmt.Errorf("%s: cannot start: %d goroutines of its last run are still running", s.component, s.active)
	}
	if prepare != nil {
		if err := prepare(ctx); err != nil {
			return err
		}
	}
	runCtx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	s.started, s.stopCh, s.cancel, s.finished = true, make(chan struct{}), cancel, make(chan struct{})
	s.launch(runCtx, run)
	return nil
}

// stopping is closed when Stop begins: a stopSoft component finishes what it
// holds and takes no new work.
func (s *startStop) stopping() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stopCh
}

// stopBegun reports whether Stop has begun; s.mu is held.
func (s *startStop) stopBegun() bool {
	select {
	case <-s.stopCh:
		return true
	default:
		return false
	}
}

// goOwned starts fn in a further goroutine the component owns, on a child of
// ctx; call it only from a goroutine the component owns (then the component
// cannot be fully stopped meanwhile). Stop waits for it; a panic in it is
// recovered like one in run.
func (s *startStop) goOwned(ctx context.Context, fn func(context.Context)) owned {
	s.mu.Lock()
	defer s.mu.Unlock()
	ctx, cancel := context.WithCancel(ctx)
	return owned{cancel: cancel, done: s.launch(ctx, fn)}
}

// owned is a goroutine started by goOwned.
type owned struct {
	cancel context.CancelFunc
	done   <-chan struct{}
}

// stop cancels the goroutine's context and waits for it to return.
func (o owned) stop() {
	o.cancel()
	<-o.done
}

// launch starts fn in an owned goroutine, labelled component=<name> (and
// in a trace region of that name) so every dump and trace names it; s.mu is
// held.
func (s *startStop) launch(ctx context.Context, fn func(context.Context)) <-chan struct{} {
	s.active++
	done := make(chan struct{})
	go func() {
		defer s.exited(done)
		defer s.recoverPanic()
		labelled(ctx, labelComponent, s.component.String(), func() { fn(ctx) })
	}()
	return done
}

// recoverPanic is the one place a component's panic is recovered.
func (s *startStop) recoverPanic() {
	if r := recover(); r != nil {
		s.onPanic(s.component, r)
	}
}

func (s *startStop) exited(done chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	close(done)
	if s.active--; s.active == 0 {
		close(s.finished)
	}
}

// Stop stops the component and waits for every goroutine it owns; see
// startStop for the stages and what ctx's end does.
func (s *startStop) Stop(ctx context.Context) error {
	s.mu.Lock()
	if !s.started {
		s.mu.Unlock()
		return nil
	}
	if !s.stopBegun() {
		close(s.stopCh)
		if s.mode == stopNow {
			s.cancel(errStopped)
		}
	}
	finished, cancel := s.finished, s.cancel
	s.mu.Unlock()

	select {
	case <-finished:
		cancel(errStopped)
		s.stopped(finished)
		return nil
	case <-ctx.Done():
	}
	cancel(context.Cause(ctx))
	select {
	case <-finished:
		s.stopped(finished)
		return fmt.Errorf("%s %w: %w", s.component, errStoppedHard, context.Cause(ctx))
	case <-time.After(hardStopGrace):
	}
	s.mu.Lock()
	n := s.active
	s.mu.Unlock()
	return fmt.Errorf("%s: %d %w: %w", s.component, n, errStillRunning, context.Cause(ctx))
}

// stopped marks the run that finished stopped, so Start may start again.
// Another Stop may have done so, and a new run begun, already.
func (s *startStop) stopped(finished chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.finished == finished {
		s.started = false
	}
}

// everyTick is the loop of a component that acts on a ticker: fn runs every
// interval, and at once whenever kick delivers (nil: never), until ctx ends.
// fn gets ctx and runs in the loop's goroutine, so one run never overlaps the
// next.
func everyTick(ctx context.Context, interval time.Duration, kick <-chan struct{}, fn func(context.Context)) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-kick:
		}
		fn(ctx)
	}
}
