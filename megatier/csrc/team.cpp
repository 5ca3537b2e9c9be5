// Serial host work beside the OpenMP team, with the team's other threads asleep.
//
// libgomp's idle team threads spin before they sleep (OMP_WAIT_POLICY unset:
// 300 000 spins, which libgomp's own comment puts at ~3 ms, give or take 5x
// with the CPU), so that the next parallel region starts without a futex wake.
// Serial work of the calling thread in between, like the checkpoint's after-step
// hook in a CPU training loop, therefore burns a second core for as long as it
// runs: measured on the 2-core box, 4.2 ms of spin on the team's other thread
// during a 4.3 ms hook. run_with_team_parked runs the serial work inside a parallel region in
// which every other team thread blocks on a condition variable (a futex wait,
// no CPU) until it is done; afterwards they return to the team's dock and spin
// as usual, so the next training op starts as fast as before.
//
// Inside, the caller is in a parallel region: ATen's parallel_for and our
// kernels run their loops on the calling thread alone (nested regions get one
// thread), so work that wants the team belongs before or after.
#include "team.h"

#include <condition_variable>
#include <exception>
#include <mutex>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace megatier {

namespace py = pybind11;

py::object run_with_team_parked(const py::function& fn) {
#ifdef _OPENMP
  const int team = omp_get_max_threads();
  if (team <= 1 || omp_in_parallel()) return fn();
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  py::object result;
  std::exception_ptr error;
  {
    py::gil_scoped_release nogil;  // the parked threads never touch Python; the caller takes it back below
#pragma omp parallel num_threads(team)
    {
      if (omp_get_thread_num() == 0) {  // the calling thread: run fn, then wake the others
        {
          py::gil_scoped_acquire gil;
          try {
            result = fn();
          } catch (...) {  // no exception may leave a parallel region; rethrown below
            error = std::current_exception();
          }
        }
        {
          std::lock_guard<std::mutex> lock(mu);
          done = true;
        }
        cv.notify_all();
      } else {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return done; });
      }
    }
  }
  if (error) std::rethrow_exception(error);
  return result;
#else
  return fn();
#endif
}

}  // namespace megatier
