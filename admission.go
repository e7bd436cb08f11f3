package main

import (
	"math"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/labstack/echo/v4"
)

// Admission control on the API port: how many requests this instance works
// on at once. Past its capacity a service that admits everything only makes
// every request slower, until they all miss their deadlines and goodput
// collapses; one that admits a bounded number keeps their latency and
// answers the rest at once with 503 and Retry-After, so a client or load
// balancer tries elsewhere or later while the answer is still cheap.
//
// Why a concurrency limit and not a queue: a queue in front of a saturated
// service only adds waiting, and a request that waited for half its budget
// is likely to miss the rest of it; refusing at the door costs a few
// microseconds and keeps the 503s fast. Why an adaptive one: the right
// number depends on the machine, the database and the mix of requests, and
// changes with them; a fixed one is either too low (refusing work the
// instance could do) or too high (no protection).
//
// The limit follows latency, in the spirit of Netflix's concurrency-limits
// Gradient2 (no maintained Go port is on the module proxy; the logic is the
// ~100 lines below). Admitted requests are timed; every window (at least
// admissionWindow and admissionMinSamples samples) the window's median is
// compared with a long-term baseline. While the median stays within the
// tolerance of the baseline the limit grows by its square root (room to
// find more capacity, and for bursts); when it exceeds it, the limit shrinks
// in proportion (at most by half a window). The baseline is learned only
// from windows where the limit was really in use (at least half of it in
// flight): at idle the latency says nothing about capacity. And it rises
// only from windows in which the limit refused nobody: a window with
// refusals measures the overload (requests queueing for the CPU and the
// pool), not the instance, and learning from it let the limit settle at
// three times the latency of the peak rate under a sustained 3× load. It
// rises slowly (admissionBaselineWeight), so a noisy window does not teach
// it that slow is normal either; it falls fast: a median faster than the
// baseline by more than the tolerance means whatever raised it is over, and
// it follows within a few windows (admissionBaselineFall). The median, not the mean: a few slow clients
// uploading their body must not shrink everyone's limit.

const (
	// admissionWindow is the shortest window: short enough to react to an
	// overload within a fraction of a second, long enough for the median of
	// its samples to mean something at a few hundred requests a second.
	admissionWindow = 100 * time.Millisecond
	// admissionMinSamples: a window closes only with this many samples.
	admissionMinSamples = 10
	// admissionMaxSamples closes a window early under heavy traffic, and
	// bounds the memory and the sort of one window.
	admissionMaxSamples = 1000
	// admissionSmoothing is the share of a window's new limit that is taken;
	// the rest stays, so one noisy window cannot swing it.
	admissionSmoothing = 0.5
	// admissionBaselineWeight is a window's weight in the baseline: it
	// follows a change over ~600 windows, a minute at full traffic. A
	// symmetric average, so that on a noisy machine the baseline is the
	// typical latency, not its luckiest windows. admissionBaselineFall is the
	// weight of a window faster than the baseline by more than the tolerance.
	admissionBaselineWeight = 1.0 / 600
	admissionBaselineFall   = 1.0 / 4
)

// admissionConfig is the limiter's setting: the limit stays in [min, max]
// and starts at min; tolerance is how much slower than the baseline the
// median may get before the limit shrinks (1.5: 50 % slower).
type admissionConfig struct {
	min, max  int
	tolerance float64
}

// concurrencyLimiter decides which requests are worked on. Time comes from
// the caller, so a test drives it without a clock.
type concurrencyLimiter struct {
	cfg admissionConfig

	mu       sync.Mutex
	limit    float64
	inFlight int
	baseline float64 // seconds; 0 until the first window in use
	// The current window.
	windowStart time.Time
	samples     []float64 // seconds
	peak        int       // the most in flight during the window
	refused     int       // requests shed during the window
}

// newAdmission is the API's limiter as configured, shown in the metrics
// from the start; nil when KUMIKO_API_CONCURRENCY_MAX is 0.
func newAdmission(hc httpConfig, m *metrics) *concurrencyLimiter {
	if hc.ConcurrencyMax == 0 {
		return nil
	}
	l := newConcurrencyLimiter(admissionConfig{min: int(hc.ConcurrencyMin), max: int(hc.ConcurrencyMax),
		tolerance: float64(hc.LatencyTolerance) / 100}, time.Now())
	observeLimit(l, m)
	return l
}

// newConcurrencyLimiter starts at the minimum, with its first window at now.
func newConcurrencyLimiter(cfg admissionConfig, now time.Time) *concurrencyLimiter {
	return &concurrencyLimiter{cfg: cfg, limit: float64(cfg.min), windowStart: now,
		samples: make([]float64, 0, admissionMaxSamples)}
}

// acquire admits a request or says no; an admitted one must call release.
func (l *concurrencyLimiter) acquire() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.inFlight >= int(l.limit) {
		l.refused++
		return false
	}
	l.inFlight++
	l.peak = max(l.peak, l.inFlight)
	return true
}

// release ends an admitted request that took latency, at now, and says
// whether that closed a window (the limit may have moved).
func (l *concurrencyLimiter) release(latency time.Duration, now time.Time) (windowClosed bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.inFlight--
	l.samples = append(l.samples, latency.Seconds())
	if len(l.samples) < admissionMaxSamples && (len(l.samples) < admissionMinSamples || now.Sub(l.windowStart) < admissionWindow) {
		return false
	}
	l.update()
	l.windowStart, l.samples, l.peak, l.refused = now, l.samples[:0], l.inFlight, 0
	return true
}

// update ends a window: the baseline learns from it, and the limit follows.
func (l *concurrencyLimiter) update() {
	if float64(l.peak) < l.limit/2 {
		return // the limit was not in use: the latency says nothing about it
	}
	slices.Sort(l.samples)
	median := l.samples[len(l.samples)/2]
	switch {
	case l.baseline == 0:
		l.baseline = median
	case median*l.cfg.tolerance < l.baseline:
		l.baseline += (median - l.baseline) * admissionBaselineFall
	case median < l.baseline || l.refused == 0:
		l.baseline += (median - l.baseline) * admissionBaselineWeight
	}
	gradient := 1.0
	if median > 0 {
		gradient = max(0.5, min(1, l.cfg.tolerance*l.baseline/median))
	}
	next := l.limit*gradient + math.Sqrt(l.limit)
	l.limit = max(float64(l.cfg.min), min(float64(l.cfg.max), l.limit*(1-admissionSmoothing)+next*admissionSmoothing))
}

// state is what the metrics show.
func (l *concurrencyLimiter) state() (limit, inFlight int, baseline time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return int(l.limit), l.inFlight, time.Duration(l.baseline * float64(time.Second))
}

// observeLimit shows the limit and its baseline in the metrics.
func observeLimit(l *concurrencyLimiter, m *metrics) {
	limit, _, baseline := l.state()
	m.admissionLimit.Set(float64(limit))
	m.admissionBaseline.Set(baseline.Seconds())
}

// admitWithinLimit answers a request over the limit with 503 and
// Retry-After before anything of it is read, and times the admitted ones.
// It wraps only requests whose latency is the service's work: not the
// event streams, which live for minutes and have their own cap, nor
// /api/slow, which waits by design.
func admitWithinLimit(l *concurrencyLimiter, m *metrics) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			if !l.acquire() {
				m.admissionShed.Inc()
				c.Response().Header().Set("Retry-After", "1")
				return apiError(http.StatusServiceUnavailable, "overloaded", "this instance is at its capacity; retry shortly")
			}
			start := time.Now()
			m.admissionInFlight.Inc()
			defer func() {
				now := time.Now()
				m.admissionInFlight.Dec()
				if l.release(now.Sub(start), now) {
					observeLimit(l, m)
				}
			}()
			return next(c)
		}
	}
}
