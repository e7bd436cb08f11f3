package main

import (
	_ "embed"
	"net/http"

	"github.com/labstack/echo/v4"
	"github.com/redis/go-redis/v9"
)

// dashboardPage is the live dashboard: plain HTML and JavaScript, no build step.
//
//go:embed dashboard.html
var dashboardPage []byte

// handleDashboard is GET / on the API port.
func handleDashboard() echo.HandlerFunc {
	return func(c echo.Context) error {
		c.Response().Header().Set("Cache-Control", "no-store")
		return c.Blob(http.StatusOK, echo.MIMETextHTMLCharsetUTF8, dashboardPage)
	}
}

// handleInstance is GET /api/instance, what the dashboard shows: this
// instance's state and boot timeline, the leader and the live workers of all
// instances. Nothing in it is secret; the admin routes stay on the ops port.
func handleInstance(lc *Lifecycle, rdb *redis.Client, instanceID string) echo.HandlerFunc {
	return func(c echo.Context) error {
		cl, err := readCluster(c.Request().Context(), rdb)
		if err != nil {
			return err
		}
		return c.JSON(http.StatusOK, map[string]any{
			"instanceId": instanceID,
			"state":      lc.State().String(),
			"uptimeSec":  int64(lc.Uptime().Seconds()),
			"phases":     lc.Timeline(),
			"leader":     cl.Leader,
			"workers":    cl.Workers,
		})
	}
}
