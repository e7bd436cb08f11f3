package main

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/riverqueue/river"
)

// drainDemoFeature is work that takes as long as it is told to, to watch a
// drain: GET /api/slow?ms=N (off with KUMIKO_DEMO_ENDPOINTS=false, then it
// answers 404) and the sleep job an operator runs by hand.
func drainDemoFeature(cfg httpConfig) feature {
	f := feature{
		name:       "drainDemo",
		workers:    []worker{work(sleepJob)},
		manualJobs: []manualJob{byHand(sleepArgsOf)},
	}
	if cfg.DemoEndpoints {
		// Long-running: a request that sleeps holds no capacity, and its
		// duration must not teach the concurrency limit that the instance is slow.
		f.routes = []route{{method: http.MethodGet, path: "/api/slow", longRunning: true, handler: func(d routeDeps) echo.HandlerFunc {
			return handleSlow(d.cfg.HTTP.SlowMax)
		}}}
	}
	return f
}

// maxSleepJob bounds the manual sleep job (POST /admin/jobs/sleep/run): the
// range an operator may ask for, not a budget (the job itself is cut at
// KUMIKO_JOBS_TIMEOUT like any other).
const maxSleepJob = 10 * time.Minute

// handleSlow is GET /api/slow?ms=N: a request that takes N ms, to watch a
// drain. N is checked in milliseconds before any multiplication, so a huge N
// cannot overflow into an allowed duration; limit is KUMIKO_SLOW_MAX.
func handleSlow(limit time.Duration) echo.HandlerFunc {
	return func(c echo.Context) error {
		ms, err := strconv.ParseInt(c.QueryParam("ms"), 10, 64)
		if err != nil || ms < 0 || ms > limit.Milliseconds() {
			return apiError(http.StatusBadRequest, "invalid_ms", fmt.Sprintf("ms must be an integer from 0 to %d", limit.Milliseconds()))
		}
		select {
		case <-time.After(time.Duration(ms) * time.Millisecond):
			return c.JSON(http.StatusOK, map[string]int64{"sleptMs": ms})
		case <-c.Request().Context().Done():
			return nil // the client left, or the drain force-closed the connection
		}
	}
}

// sleepArgs is a job that takes Ms milliseconds, to watch a job survive a
// drain or a crash.
type sleepArgs struct {
	Ms int `json:"ms"`
}

func (sleepArgs) Kind() string { return "sleep" }

func sleepArgsOf(c echo.Context) (sleepArgs, error) {
	ms, err := strconv.Atoi(c.QueryParam("ms"))
	if err != nil || ms < 0 || ms > int(maxSleepJob.Milliseconds()) {
		return sleepArgs{}, apiError(http.StatusBadRequest, "invalid_ms", fmt.Sprintf("ms must be an integer from 0 to %d", maxSleepJob.Milliseconds()))
	}
	return sleepArgs{Ms: ms}, nil
}

// sleepJob takes its time, honouring cancellation: a stop cancels it and
// River runs it again later, here or elsewhere.
func sleepJob(_ workDeps, ctx context.Context, job *river.Job[sleepArgs]) error {
	return sleepCtx(ctx, time.Duration(job.Args.Ms)*time.Millisecond)
}
